package osmo

import (
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
)

// The loops that check sample ids and tool names accept exactly what the
// regular expressions of their rules accept.
func TestIDCheckersMatchTheirPatterns(t *testing.T) {
	sampleID := regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$`)
	toolName := regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
	const alphabet = "aZ09._:@+-/ é\x00\xff"
	rng := rand.New(rand.NewPCG(1, 2))
	cases := []string{"", ".", "..", "a", "-a", "a-", strings.Repeat("a", 64), strings.Repeat("a", 65),
		strings.Repeat("b", 128), strings.Repeat("b", 129), "s.1:x@y+z-w_v", "main agent", "é"}
	for range 20000 {
		n := rng.IntN(140)
		var b strings.Builder
		for range n {
			b.WriteByte(alphabet[rng.IntN(len(alphabet))])
		}
		cases = append(cases, b.String())
	}
	for _, s := range cases {
		if got, want := ValidSampleID(s) == nil, sampleID.MatchString(s); got != want {
			t.Errorf("ValidSampleID(%q) accepts: %v, pattern: %v", s, got, want)
		}
		if got, want := validToolName(s), toolName.MatchString(s); got != want {
			t.Errorf("validToolName(%q) = %v, pattern: %v", s, got, want)
		}
	}
}
