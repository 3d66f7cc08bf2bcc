package rows

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/osmo-rl/osmo"
)

// Samples whose prompts are Qwen3's own chat template rendered and
// tokenized (testdata/qwen3/fixtures.mjs writes them): the classes found
// are the ones the scenario produced, and every row is token-exact.
func TestQwen3Template(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "qwen3", "calls.json"))
	if err != nil {
		t.Fatal(err)
	}
	var samples []struct {
		Name  string          `json:"name"`
		Want  []string        `json:"want"`
		Calls []*osmo.LLMCall `json:"calls"`
	}
	if err := json.Unmarshal(b, &samples); err != nil {
		t.Fatal(err)
	}
	if len(samples) == 0 {
		t.Fatal("no samples")
	}
	for _, s := range samples {
		t.Run(s.Name, func(t *testing.T) {
			for _, o := range []Options{{VocabSize: 151936}, {VocabSize: 151936, Merge: ModeRealign}} {
				res := Build(Sample{Calls: s.Calls}, o)
				checkInvariants(t, s.Calls, o, res)
				var classes []string
				for _, r := range res.Rows {
					for _, d := range r.Drift {
						classes = append(classes, d.Class)
					}
				}
				t.Logf("%s %s: %s", s.Name, o.Merge, describeAll(res))
				if !slices.Equal(classes, s.Want) && !(len(classes) == 0 && len(s.Want) == 0) {
					t.Errorf("%s: drift %v, want %v", o.Merge, classes, s.Want)
				}
				wantRows := 1 + len(s.Want)
				if o.Merge == ModeRealign {
					wantRows = 1
				}
				if len(res.Rows) != wantRows || len(res.Problems) != 0 {
					t.Errorf("%s: %d rows, want %d", o.Merge, len(res.Rows), wantRows)
				}
			}
		})
	}
}
