package execagent_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/workflows/execagent"
)

func TestParseCommand(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in      string
		want    []string
		wantErr string
		offset  int
	}{
		{in: "python3 agent.py", want: []string{"python3", "agent.py"}},
		{in: "  node\t dist/main.js  --flag=1\n", want: []string{"node", "dist/main.js", "--flag=1"}},
		{in: `sh -c 'echo "$HOME" | tr a b'`, want: []string{"sh", "-c", `echo "$HOME" | tr a b`}},
		{in: `echo "a \"b\" \\ \$x \` + "`" + `y\n"`, want: []string{"echo", `a "b" \ $x ` + "`" + `y\n`}},
		{in: `a\ b c\'d`, want: []string{"a b", "c'd"}},
		{in: `x""y ''`, want: []string{"xy", ""}},
		{in: `"" z`, want: []string{"", "z"}},
		{in: `pre'mid dle'post"x y"`, want: []string{"premid dlepostx y"}},
		{in: "one \\\ntwo", want: []string{"one", "two"}},
		{in: "jo\\\nined", want: []string{"joined"}},
		{in: "\"multi\\\nline\"", want: []string{"multiline"}},
		{in: `$HOME ~/x *.py a#b`, want: []string{"$HOME", "~/x", "*.py", "a#b"}},
		{in: `'a|b' "c;d" e\&f`, want: []string{"a|b", "c;d", "e&f"}},
		{in: "héllo wörld", want: []string{"héllo", "wörld"}},
		{in: "", wantErr: "empty command"},
		{in: " \t\n ", wantErr: "empty command"},
		{in: `echo 'abc`, wantErr: "unterminated single quote", offset: 5},
		{in: `echo "abc`, wantErr: "unterminated double quote", offset: 5},
		{in: `echo "a\"`, wantErr: "unterminated double quote", offset: 5},
		{in: `echo abc\`, wantErr: "trailing backslash", offset: 8},
		{in: `python3 agent.py | tee log`, wantErr: `unquoted '|'`, offset: 17},
		{in: `a && b`, wantErr: `unquoted '&'`, offset: 2},
		{in: `a > out`, wantErr: `unquoted '>'`, offset: 2},
		{in: "echo `id`", wantErr: "unquoted '`'", offset: 5},
		{in: `run # comment`, wantErr: "comment", offset: 4},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := execagent.ParseCommand(tc.in)
			if tc.wantErr == "" {
				if err != nil || !reflect.DeepEqual(got, tc.want) {
					t.Fatalf("ParseCommand(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
				}
				return
			}
			var syn *execagent.SyntaxError
			if !errors.As(err, &syn) || !strings.Contains(err.Error(), tc.wantErr) || syn.Offset != tc.offset {
				t.Fatalf("ParseCommand(%q) = %q, %v; want a SyntaxError at %d saying %q", tc.in, got, err, tc.offset, tc.wantErr)
			}
		})
	}
}
