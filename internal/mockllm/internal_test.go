package mockllm

import (
	"strings"
	"testing"
)

func TestTokenizeRoundTrips(t *testing.T) {
	for _, s := range []string{
		"", "The answer is 87.\n#### 87", `{"a":12,"b":7}`, "  two  spaces\n\n  and tabs\t",
		"héllo wörld, ünïcode ✓", " leading", "trailing ",
	} {
		pieces := tokenize(s)
		if got := strings.Join(pieces, ""); got != s {
			t.Errorf("tokenize(%q) joins back to %q", s, got)
		}
		for _, p := range pieces {
			if p == "" {
				t.Errorf("tokenize(%q) has an empty piece: %q", s, pieces)
			}
		}
	}
	if got := tokenize("The answer is 87.\n#### 87"); len(got) != 8 || got[1] != " answer" || got[6] != "####" {
		t.Errorf("pieces %q", got)
	}
}

func TestFindExpression(t *testing.T) {
	for _, tc := range []struct {
		text, src string
		ok        bool
	}{
		{"What is 12 * 7 + 3?", "12 * 7 + 3", true},
		{"Compute (3 + 4) * 5.", "(3 + 4) * 5", true},
		{"Step 1: what is 6 Times 7?", "6 * 7", true},
		{"What is 8 divided by 2 minus 1?", "8 / 2 - 1", true},
		{"What is 3×4?", "3*4", true},
		{"a well-known fact, 42", "", false},
		{"What is (1 + 2?", "", false},
		{"What is " + strings.Repeat("(", 100) + "1+1" + strings.Repeat(")", 100) + "?", "", false},
	} {
		_, src, ok := findExpression(tc.text)
		if ok != tc.ok || src != tc.src {
			t.Errorf("findExpression(%q) = %q, %v; want %q, %v", tc.text, src, ok, tc.src, tc.ok)
		}
	}
}

func TestFormatNumber(t *testing.T) {
	for v, want := range map[float64]string{87: "87", -4: "-4", 3.5: "3.5", 1.0 / 3: "0.333333", 2.0000001: "2", -0.0000001: "0", 1e15: "1000000000000000"} {
		if got := formatNumber(v); got != want {
			t.Errorf("formatNumber(%v) = %q, want %q", v, got, want)
		}
	}
}
