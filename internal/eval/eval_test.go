package eval_test

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/parquet-go/parquet-go"

	"github.com/osmo-rl/osmo/internal/eval"
)

func write(t *testing.T, dir, name, text string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	t.Run("defaults and paths", func(t *testing.T) {
		p := write(t, dir, "ok.toml", "[experiment]\nrollout = \"multiply\"\nmodel_path = \"openai/gpt-4o-mini\"\ndataset = \"rows.jsonl\"\n")
		c, err := eval.LoadConfig(p)
		if err != nil {
			t.Fatal(err)
		}
		v := c.Evaluation
		if v.N != 1 || v.BatchSize != eval.DefaultBatchSize || *v.PassThreshold != 1 || *v.AgentTimeoutS != 450 || *v.GraderTimeoutS != 150 {
			t.Errorf("defaults: %+v", v)
		}
		write(t, dir, "rows.jsonl", `{"user_prompt":"q"}`+"\n")
		l, err := c.Resolve("", "")
		if err != nil {
			t.Fatal(err)
		}
		if c.Model() != "gpt-4o-mini" || l.DatasetPath != filepath.Join(dir, "rows.jsonl") || c.LLM.APIKeyEnv != "OPENAI_API_KEY" {
			t.Errorf("model %q dataset %q key env %q", c.Model(), l.DatasetPath, c.LLM.APIKeyEnv)
		}
		if l.OutputRoot != filepath.Join(dir, ".osmosis", "evals") || l.RolloutDir != "" || l.Workspace != "" {
			t.Errorf("layout %+v", l)
		}
	})
	for _, tc := range []struct {
		name, text, want string
	}{
		{"syntax", "[experiment]\nrollout = \"multiply\n", ":2"},
		{"wrong type", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[evaluation]\nn = \"two\"\n", "evaluation.n"},
		{"unknown key", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\nmodel = \"x\"\n", ":5: experiment.model: unknown key"},
		{"n below 1", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[evaluation]\nn = 0\n", ":6: evaluation.n: must be a positive integer"},
		{"no rollout", "[experiment]\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n", "experiment.rollout: Missing 'rollout' in [experiment] section"},
		{"exec without entrypoint", "[experiment]\nrollout = \"exec\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n", "experiment.entrypoint: required"},
		{"negative budget", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[evaluation]\ngrader_timeout_s = -1\n", "evaluation.grader_timeout_s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := eval.LoadConfig(write(t, dir, "bad.toml", tc.text))
			var ce *eval.ConfigError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want a ConfigError mentioning %q", err, tc.want)
			}
		})
	}
}

// parquetRow is a dataset row as a Parquet file holds it.
type parquetRow struct {
	UserPrompt   string `parquet:"user_prompt"`
	GroundTruth  string `parquet:"ground_truth"`
	SystemPrompt string `parquet:"system_prompt,optional"`
	Metadata     string `parquet:"metadata,optional"`
	Difficulty   int64  `parquet:"difficulty"`
}

func TestLoadDatasetFormatsAgree(t *testing.T) {
	dir := t.TempDir()
	jsonl := write(t, dir, "d.jsonl", `{"system_prompt":"Be brief.","user_prompt":"What is 2 times 3?","ground_truth":"6","metadata":{"source":"x"},"difficulty":1}
{"user_prompt":"What is 4 times 5?","label":20,"difficulty":2}
`)
	csvPath := write(t, dir, "d.csv", "system_prompt,user_prompt,ground_truth,metadata,difficulty\n"+
		"Be brief.,What is 2 times 3?,6,\"{\"\"source\"\":\"\"x\"\"}\",1\n,What is 4 times 5?,20,,2\n")
	pq := filepath.Join(dir, "d.parquet")
	if err := parquet.WriteFile(pq, []parquetRow{
		{UserPrompt: "What is 2 times 3?", GroundTruth: "6", SystemPrompt: "Be brief.", Metadata: `{"source":"x"}`, Difficulty: 1},
		{UserPrompt: "What is 4 times 5?", GroundTruth: "20", Difficulty: 2},
	}); err != nil {
		t.Fatal(err)
	}
	want, err := eval.LoadDataset(jsonl)
	if err != nil {
		t.Fatal(err)
	}
	if len(want) != 2 || len(want[0].Messages) != 2 || want[0].Messages[0]["role"] != "system" || *want[1].Label != "20" ||
		want[0].Metadata["source"] != "x" || want[0].Metadata["difficulty"] != int64(1) {
		t.Fatalf("jsonl rows = %+v", want)
	}
	for _, p := range []string{csvPath, pq} {
		got, err := eval.LoadDataset(p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		// CSV cells are text: the extra column comes back as a string.
		for i := range got {
			if d, ok := got[i].Metadata["difficulty"].(string); ok && d == map[int]string{0: "1", 1: "2"}[i] {
				got[i].Metadata["difficulty"] = int64(i + 1)
			}
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s rows\n%+v\nwant\n%+v", filepath.Ext(p), got, want)
		}
	}
}

func TestLoadDatasetErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, file, text, want string
	}{
		{"no user_prompt", "a.jsonl", `{"question":"hi","ground_truth":"1"}`, "a.jsonl: row 0: user_prompt: missing"},
		{"metadata not an object", "b.jsonl", "{\"user_prompt\":\"q\"}\n{\"user_prompt\":\"q\",\"metadata\":[1]}\n", "b.jsonl: row 1: metadata: must be a JSON object"},
		{"metadata text not an object", "c.csv", "user_prompt,metadata\nq,not json\n", "c.csv: row 0: metadata: must be a JSON object"},
		{"empty", "d.jsonl", "\n", "d.jsonl: the dataset has no rows"},
		{"not an object", "e.jsonl", "[1,2]\n", "e.jsonl: row 0: line 1 is not a JSON object"},
		{"format", "f.txt", "x", "unknown format"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := eval.LoadDataset(write(t, dir, tc.file, tc.text))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestParseRows(t *testing.T) {
	got, err := eval.ParseRows("3,7,10-12, 7")
	if err != nil || !reflect.DeepEqual(got, []int{3, 7, 10, 11, 12}) {
		t.Fatalf("%v %v", got, err)
	}
	for _, bad := range []string{"", "a", "5-3", "-1", "1-"} {
		if _, err := eval.ParseRows(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func f(v float64) *float64 { return &v }

func TestSummarize(t *testing.T) {
	results := []eval.Result{
		{RowIndex: 0, RunIndex: 0, Status: eval.StatusSuccess, Reward: f(1), Tokens: 10},
		{RowIndex: 0, RunIndex: 1, Status: eval.StatusSuccess, Reward: f(0), Tokens: 10},
		{RowIndex: 1, RunIndex: 0, Status: eval.StatusFailure, ErrCategory: "timeout", Tokens: 5},
		{RowIndex: 1, RunIndex: 1, Status: eval.StatusFailure, ErrCategory: "agent_error"},
		{RowIndex: 2, RunIndex: 0, Status: eval.StatusSkipped, Tokens: 3},
		{RowIndex: 2, RunIndex: 1, Status: eval.StatusSuccess, Reward: f(1)},
	}
	s := eval.Summarize(results, 2, 1.0, 1.5)
	want := eval.Summary{
		TotalSamples: 6, CompletedSamples: 5, Graded: 3, Passed: 2, Failed: 2, Skipped: 1,
		PassRate: 2.0 / 5, PassThreshold: 1, TokensUsed: 28, MeanReward: f(2.0 / 3),
		// pass@1: rows 0 (1 of 2), 1 (0 of 2), 2 (1 of 1): (0.5+0+1)/3;
		// pass@2: rows 0 and 1 only: (1+0)/2.
		PassAtK:          map[string]float64{"1": 0.5, "2": 0.5},
		ErrorsByCategory: map[string]int{"timeout": 1, "agent_error": 1},
		WallS:            1.5,
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("summary\n%+v\nwant\n%+v", s, want)
	}
	for _, tc := range []struct {
		n, c, k int
		want    float64
	}{{5, 0, 1, 0}, {5, 5, 3, 1}, {5, 1, 1, 0.2}, {5, 1, 2, 0.4}, {4, 2, 2, 1 - 1.0/6}} {
		if got := eval.PassAtK(tc.n, tc.c, tc.k); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("pass@%d with %d of %d = %v, want %v", tc.k, tc.c, tc.n, got, tc.want)
		}
	}
}

func TestJournal(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, eval.ResultsFile)
	j, done, err := eval.OpenJournal(path)
	if err != nil || len(done) != 0 {
		t.Fatal(done, err)
	}
	for _, r := range []eval.Result{
		{RowIndex: 0, RunIndex: 0, RolloutID: "a", Status: eval.StatusFailure},
		{RowIndex: 1, RunIndex: 0, RolloutID: "b", Status: eval.StatusSuccess, Reward: f(1)},
		{RowIndex: 0, RunIndex: 0, RolloutID: "c", Status: eval.StatusSuccess, Reward: f(1)},
	} {
		if err := j.Append(r); err != nil {
			t.Fatal(err)
		}
	}
	_ = j.Close()
	// A kill -9 mid-write leaves a torn last line.
	fh, _ := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	_, _ = fh.WriteString(`{"row_index":2,"run_ind`)
	_ = fh.Close()

	j, done, err = eval.OpenJournal(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(done) != 2 || done[eval.Key{Row: 0, Run: 0}].RolloutID != "c" {
		t.Fatalf("done = %v: want the last result per attempt and no torn line", done)
	}
	if err := j.Append(eval.Result{RowIndex: 2, RunIndex: 0, RolloutID: "d", Status: eval.StatusSuccess}); err != nil {
		t.Fatal(err)
	}
	_ = j.Close()
	if _, done, err = eval.OpenJournal(path); err != nil || len(done) != 3 {
		t.Fatalf("after the torn line was cut: %v %v", done, err)
	}
	// A bad line that is not the last is not the writer's: refused.
	write(t, dir, "bad.jsonl", "garbage\n{\"rollout_id\":\"x\"}\n")
	if _, _, err := eval.OpenJournal(filepath.Join(dir, "bad.jsonl")); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("err = %v", err)
	}
}
