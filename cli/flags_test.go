package cli

import (
	"context"
	"errors"
	"flag"
	"io"
	"regexp"
	"strings"
	"testing"
)

// argNameRE is what a flag's argument name in -h output may be: the flag
// package's name for the type (string, int, duration, ...) or a back-quoted
// placeholder such as DIR or FILE, never words of a sentence.
var argNameRE = regexp.MustCompile(`^(?:string|int|int64|uint|uint64|float|duration|value|[A-Z][A-Z0-9_]*)$`)

// TestFlagUsageNames walks the flags of every subcommand: the flag package
// takes a back-quoted word of a usage string as the flag's argument name
// (flag.UnquoteUsage), so back quotes are only for that.
func TestFlagUsageNames(t *testing.T) {
	for sub, cmd := range commands() {
		var sets []*flag.FlagSet
		e := &env{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }, reg: newRegistry(nil),
			flagSets: func(fs *flag.FlagSet) { sets = append(sets, fs) }}
		err := cmd.run(context.Background(), e, []string{"-h"})
		if len(sets) == 0 {
			if sub != "version" {
				t.Errorf("osmo %s made no FlagSet (run: %v)", sub, err)
			}
			continue
		}
		if !errors.Is(err, flag.ErrHelp) {
			t.Errorf("osmo %s -h: %v, want flag.ErrHelp", sub, err)
		}
		for _, fs := range sets {
			fs.VisitAll(func(f *flag.Flag) {
				name, usage := flag.UnquoteUsage(f)
				if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
					if name != "" {
						t.Errorf("osmo %s: bool flag -%s shows argument %q (usage %q)", sub, f.Name, name, f.Usage)
					}
				} else if !argNameRE.MatchString(name) {
					t.Errorf("osmo %s: flag -%s shows argument %q (usage %q)", sub, f.Name, name, f.Usage)
				}
				if strings.Contains(usage, "`") {
					t.Errorf("osmo %s: flag -%s usage keeps a back quote: %q", sub, f.Name, usage)
				}
			})
		}
	}
}
