//go:build unix

package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/parquet-go/parquet-go"

	"github.com/osmo-rl/osmo/internal/eval"
	"github.com/osmo-rl/osmo/internal/qwen3policy"
)

// TestEvalWritesRows: `osmo eval run --mock` on osmo's own rollout server
// asks the policy for tokens and writes every sample's training rows,
// rows.jsonl and rows.parquet alike, each row's arrays of one length, its
// logprobs 0 off the loss mask, the summary counting them; with [rows]
// enabled = false it asks nothing and writes no rows file.
func TestEvalWritesRows(t *testing.T) {
	toml := filepath.Join("..", "examples", "eval", "multiply.toml")
	out := filepath.Join(t.TempDir(), "run")
	if code, output := runEval(t, toml, "--mock", "--limit", "4", "--output", filepath.Dir(out), "--name", filepath.Base(out)); code != 0 {
		t.Fatalf("exit %d:\n%s", code, output)
	}
	type row struct {
		RowIndex int64     `json:"row_index" parquet:"row_index"`
		RunIndex int64     `json:"run_index" parquet:"run_index"`
		TokenIDs []int32   `json:"token_ids" parquet:"token_ids,list"`
		LossMask []int32   `json:"loss_mask" parquet:"loss_mask,list"`
		Logprobs []float64 `json:"logprobs" parquet:"logprobs,list"`
		Merge    string    `json:"merge" parquet:"merge"`
	}
	f, err := os.Open(filepath.Join(out, eval.RowsFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []row
	samples := map[[2]int64]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 64<<20)
	for sc.Scan() {
		var r row
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, r)
		samples[[2]int64{r.RowIndex, r.RunIndex}] = true
		if len(r.TokenIDs) == 0 || len(r.LossMask) != len(r.TokenIDs) || len(r.Logprobs) != len(r.TokenIDs) {
			t.Errorf("row %d/%d: %d tokens, %d mask, %d logprobs", r.RowIndex, r.RunIndex, len(r.TokenIDs), len(r.LossMask), len(r.Logprobs))
		}
		for i, m := range r.LossMask {
			if m == 0 && r.Logprobs[i] != 0 {
				t.Errorf("row %d/%d: logprob %g off the loss mask at %d", r.RowIndex, r.RunIndex, r.Logprobs[i], i)
				break
			}
		}
	}
	// 4 rows × 2 runs, each with rows.
	if len(samples) != 8 {
		t.Errorf("rows of %d samples, want 8", len(samples))
	}
	pq, err := parquet.ReadFile[row](filepath.Join(out, eval.RowsParquetFile))
	if err != nil || len(pq) != len(rows) {
		t.Fatalf("rows.parquet: %d rows (%v), rows.jsonl %d", len(pq), err, len(rows))
	}
	for i := range pq {
		if pq[i].RowIndex != rows[i].RowIndex || pq[i].Merge != rows[i].Merge || len(pq[i].TokenIDs) != len(rows[i].TokenIDs) {
			t.Errorf("row %d: parquet %+v, jsonl %+v", i, pq[i], rows[i])
		}
	}
	s := readSummary(t, out)
	if s.Rows == nil || s.Rows.Samples != 8 || s.Rows.SamplesWithRows != 8 || s.Rows.Rows != len(rows) {
		t.Errorf("summary rows %+v, want 8 samples with rows, %d rows", s.Rows, len(rows))
	}

	// Rows off.
	off := filepath.Join(t.TempDir(), "off.toml")
	b, err := os.ReadFile(toml)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(off, bytes.Replace(b, []byte("enabled = true"), []byte("enabled = false"), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	dataset, _ := filepath.Abs(filepath.Join("..", "examples", "eval", "multiply.jsonl"))
	offOut := filepath.Join(t.TempDir(), "run")
	if code, output := runEval(t, off, "--mock", "--limit", "2", "--dataset-file", dataset, "--output", filepath.Dir(offOut), "--name", filepath.Base(offOut)); code != 0 {
		t.Fatalf("rows off: exit %d:\n%s", code, output)
	}
	for _, name := range []string{eval.RowsFile, eval.RowsParquetFile} {
		if _, err := os.Stat(filepath.Join(offOut, name)); !os.IsNotExist(err) {
			t.Errorf("rows off: %s: %v, want none", name, err)
		}
	}
	for _, r := range readResults(t, offOut) {
		if len(r.LLMCalls) != 0 {
			t.Errorf("rows off: result %s keeps %d calls", r.RolloutID, len(r.LLMCalls))
		}
	}
}

// TestEvalRowsOnTheQwen3Double: `osmo eval run` of the multiply workflow
// against the vLLM-like Qwen3 double, one scenario each: every row is
// token-exact against what the double saw and generated (each completion
// the row holds is a call's, after exactly that call's prompt, with its
// logprobs), and the drift the summary counts is the scenario's.
func TestEvalRowsOnTheQwen3Double(t *testing.T) {
	policy := qwen3policy.Start(t, qwen3policy.Options{})
	data, err := os.ReadFile(filepath.Join("..", "examples", "eval", "multiply.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		scenario, merge string
		byMerge         map[string]int
		drift           map[string]int
	}{
		{"plain", "exact", map[string]int{"exact": 3}, map[string]int{}},
		{"reasoning", "exact", map[string]int{"exact": 3, "forked": 3}, map[string]int{"reasoning_dropped": 3}},
		{"reserialize", "exact", map[string]int{"exact": 3, "forked": 3}, map[string]int{"tool_call_reserialized": 3}},
		{"nothink", "exact", map[string]int{"exact": 3, "forked": 3}, map[string]int{"reasoning_dropped": 3}},
		{"reasoning", "realign", map[string]int{"realigned": 3}, map[string]int{"reasoning_dropped": 3}},
	} {
		t.Run(tc.scenario+"/"+tc.merge, func(t *testing.T) {
			if err := policy.Reset(t.Context()); err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, "rows.jsonl"), data, 0o644); err != nil {
				t.Fatal(err)
			}
			toml := filepath.Join(dir, "q.toml")
			if err := os.WriteFile(toml, fmt.Appendf(nil, "[experiment]\nrollout = \"multiply\"\nmodel_path = \"openai/qwen3-%s\"\ndataset = \"rows.jsonl\"\n"+
				"[evaluation]\nlimit = 3\nbatch_size = 1\n[llm]\nbase_url = %q\napi_key_env = \"OSMO_TEST_EVAL_KEY\"\n[rows]\nmerge = %q\n",
				tc.scenario, policy.URL(), tc.merge), 0o644); err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(dir, "out", "run")
			if code, output := runEval(t, toml, "--output", filepath.Dir(out), "--name", filepath.Base(out)); code != 0 {
				t.Fatalf("exit %d:\n%s", code, output)
			}
			s := readSummary(t, out)
			if s.Rows == nil || !maps.Equal(s.Rows.ByMerge, tc.byMerge) || !maps.Equal(s.Rows.Drift, tc.drift) || s.Rows.SamplesWithRows != 3 {
				t.Errorf("rows summary %+v, want merges %v and drift %v", s.Rows, tc.byMerge, tc.drift)
			}
			calls, err := policy.Record(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(filepath.Join(out, eval.RowsFile))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			sc := bufio.NewScanner(f)
			sc.Buffer(nil, 64<<20)
			for sc.Scan() {
				var r struct {
					TokenIDs []int     `json:"token_ids"`
					LossMask []int     `json:"loss_mask"`
					Logprobs []float64 `json:"logprobs"`
					Merge    string    `json:"merge"`
				}
				if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
					t.Fatal(err)
				}
				for i := 0; i < len(r.LossMask); {
					if r.LossMask[i] == 0 {
						i++
						continue
					}
					end := i
					for end < len(r.LossMask) && r.LossMask[end] == 1 {
						end++
					}
					// A realigned row holds the policy's own tokens where
					// the template re-rendered them: only its completions
					// are checked, each against a call's.
					found := false
					for _, c := range calls {
						if slices.Equal(c.CompletionIDs, r.TokenIDs[i:end]) && slices.Equal(c.Logprobs, r.Logprobs[i:end]) &&
							(r.Merge == "realigned" || slices.Equal(c.PromptIDs, r.TokenIDs[:i])) {
							found = true
							break
						}
					}
					if !found {
						t.Errorf("a %s row's tokens %d-%d are no call's completion after that call's prompt", r.Merge, i, end)
					}
					i = end
				}
			}
		})
	}
}
