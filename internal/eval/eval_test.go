package eval_test

import (
	"encoding/json"
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

// loadDataset reads and checks every row of a dataset file.
func loadDataset(path string) ([]eval.Row, error) {
	d, err := eval.ReadDataset(path)
	if err != nil {
		return nil, err
	}
	return d.Select("", 0, 0)
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
	t.Run("rows", func(t *testing.T) {
		base := "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n"
		v02 := "[eval]\nrollout = \"m\"\nentrypoint = \"main.py\"\ndataset = \"d.jsonl\"\n[llm]\nmodel = \"p/m\"\n"
		for _, tc := range []struct {
			name, text string
			on         bool
			merge      string
			vocab      int
		}{
			{"default", base, true, "exact", 0},
			{"off", base + "[rows]\nenabled = false\n", false, "exact", 0},
			{"realign", base + "[rows]\nenabled = true\nmerge = \"realign\"\n", true, "realign", 0},
			{"v0.2 file", v02 + "[rows]\nmerge = \"realign\"\nenabled = false\n", false, "realign", 0},
			{"vocabulary", base + "[rows]\nvocab_size = 151669\n", true, "exact", 151669},
		} {
			c, err := eval.LoadConfig(write(t, dir, "rows.toml", tc.text))
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			if c.Rows.On() != tc.on || c.Rows.Merge != tc.merge || c.Rows.VocabSize != tc.vocab {
				t.Errorf("%s: rows on %v merge %q vocabulary %d, want %v %q %d", tc.name, c.Rows.On(), c.Rows.Merge, c.Rows.VocabSize, tc.on, tc.merge, tc.vocab)
			}
		}
	})
	t.Run("engines", func(t *testing.T) {
		c, err := eval.LoadConfig(write(t, dir, "engines.toml", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[llm]\nengines = [\"http://vllm-0:8000/v1\", \"dns://vllm:8000/v1\"]\n"))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(c.LLM.Engines, " ") != "http://vllm-0:8000/v1 dns://vllm:8000/v1" {
			t.Errorf("engines %q", c.LLM.Engines)
		}
	})
	for _, tc := range []struct {
		name, text, want string
	}{
		{"bad engine", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[llm]\nengines = [\"vllm:8000\"]\n", "llm.engines: each engine is an http(s) base URL"},
		{"syntax", "[experiment]\nrollout = \"multiply\n", ":2"},
		{"wrong type", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[evaluation]\nn = \"two\"\n", "evaluation.n"},
		{"unknown key", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\nmodel = \"x\"\n", ":5: experiment.model: unknown key"},
		{"n below 1", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[evaluation]\nn = 0\n", ":6: evaluation.n: must be a positive integer"},
		{"no rollout", "[experiment]\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n", "experiment.rollout: Missing 'rollout' in [experiment] section"},
		{"exec without entrypoint", "[experiment]\nrollout = \"exec\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n", "experiment.entrypoint: required"},
		{"negative budget", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[evaluation]\ngrader_timeout_s = -1\n", "evaluation.grader_timeout_s"},
		{"bad merge", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[rows]\nmerge = \"forked\"\n", `:6: rows.merge: must be "exact" or "realign", got "forked"`},
		{"rows enabled not a bool", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[rows]\nenabled = \"no\"\n", "rows.enabled"},
		{"negative vocabulary", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[rows]\nvocab_size = -1\n", ":6: rows.vocab_size: must be 0 (unknown) or more, got -1"},
		{"unknown rows key", "[experiment]\nrollout = \"m\"\nmodel_path = \"p/m\"\ndataset = \"d.jsonl\"\n[rows]\nmode = \"exact\"\n", ":6: rows.mode: unknown key"},
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
	want, err := loadDataset(jsonl)
	if err != nil {
		t.Fatal(err)
	}
	if len(want) != 2 || len(want[0].Messages) != 2 || want[0].Messages[0]["role"] != "system" || *want[1].Label != "20" ||
		want[0].Metadata["source"] != "x" || want[0].Metadata["difficulty"] != int64(1) {
		t.Fatalf("jsonl rows = %+v", want)
	}
	for _, p := range []string{csvPath, pq} {
		got, err := loadDataset(p)
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
			_, err := loadDataset(write(t, dir, tc.file, tc.text))
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
		{RowIndex: 1, RunIndex: 0, Status: eval.StatusFailed, ErrCategory: "callback_timeout", Tokens: 5},
		{RowIndex: 1, RunIndex: 1, Status: eval.StatusFailed, ErrCategory: "agent_error"},
		{RowIndex: 2, RunIndex: 0, Status: eval.StatusSkipped, Tokens: 3},
		{RowIndex: 2, RunIndex: 1, Status: eval.StatusSuccess, Reward: f(1)},
	}
	s := eval.Summarize(results, 1.0, 1.5)
	want := eval.Summary{
		PlatformSummary: eval.PlatformSummary{
			TotalSamples: 6, CompletedSamples: 5, Graded: 3, Passed: 2, Failed: 2, Skipped: 1,
			PassRate: 2.0 / 5, PassThreshold: 1, TokensUsed: 28,
			RewardStats: &eval.RewardStats{Mean: 2.0 / 3, Median: 1, Std: math.Sqrt(2.0 / 9), Min: 0, Max: 1},
			NRuns:       2,
			// pass@1: rows 0 (1 of 2), 1 (0 of 2), 2 (1 of 1): (0.5+0+1)/3;
			// pass@2: rows 0 and 1 only: (1+0)/2.
			PassAtK: []eval.PassAtKPoint{{K: 1, Value: 0.5}, {K: 2, Value: 0.5}},
		},
		MeanReward:       f(2.0 / 3),
		ErrorsByCategory: map[string]int{"callback_timeout": 1, "agent_error": 1},
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

// TestSummarizePassAtKPoints: pass@k is a list of points at k = 1, 2, 4, …
// up to the most runs of a row, written only with two points or more (as
// the SDK writes it); one run per row has neither pass_at_k nor n_runs.
func TestSummarizePassAtKPoints(t *testing.T) {
	var results []eval.Result
	for run := range 5 {
		results = append(results, eval.Result{RowIndex: 0, RunIndex: run, Status: eval.StatusSuccess, Reward: f(float64(run % 2))})
	}
	s := eval.Summarize(results, 1, 0)
	// Row 0 passed runs 1 and 3 of 5: pass@1 = 0.4, pass@2 = 1 - C(3,2)/C(5,2)
	// = 0.7, pass@4 = 1 (3 failures cannot fill 4 draws).
	want := []eval.PassAtKPoint{{K: 1, Value: 0.4}, {K: 2, Value: 0.7}, {K: 4, Value: 1}}
	if s.NRuns != 5 || len(s.PassAtK) != len(want) {
		t.Fatalf("n_runs %d, pass_at_k %+v", s.NRuns, s.PassAtK)
	}
	for i, p := range s.PassAtK {
		if p.K != want[i].K || math.Abs(p.Value-want[i].Value) > 1e-12 {
			t.Errorf("pass_at_k[%d] = %+v, want %+v", i, p, want[i])
		}
	}
	one := eval.Summarize(results[:1], 1, 0)
	b, _ := json.Marshal(one)
	if one.NRuns != 0 || one.PassAtK != nil || strings.Contains(string(b), "pass_at_k") || strings.Contains(string(b), "n_runs") {
		t.Errorf("one run per row: %s", b)
	}
	// Two runs of which only k=1 has a row with enough scored attempts: one
	// point is no list.
	two := eval.Summarize([]eval.Result{
		{RowIndex: 0, RunIndex: 0, Status: eval.StatusSuccess, Reward: f(1)},
		{RowIndex: 0, RunIndex: 1, Status: eval.StatusSkipped},
	}, 1, 0)
	if two.NRuns != 2 || two.PassAtK != nil {
		t.Errorf("n_runs %d pass_at_k %+v, want 2 and none", two.NRuns, two.PassAtK)
	}
	if none := eval.Summarize(nil, 1, 0); none.RewardStats != nil || none.MeanReward != nil || none.PassRate != 0 {
		t.Errorf("no results: %+v", none)
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
		{RowIndex: 0, RunIndex: 0, RolloutID: "a", Status: eval.StatusFailed, ErrCategory: "agent_error"},
		{RowIndex: 1, RunIndex: 0, SourceRowIndex: 7, RolloutID: "b", Status: eval.StatusSuccess, Reward: f(1), Tokens: 12, LatencyMS: 5},
		{RowIndex: 0, RunIndex: 0, RolloutID: "c", Status: eval.StatusSuccess, Reward: f(1)},
	} {
		if err := j.Append(r); err != nil {
			t.Fatal(err)
		}
	}
	_ = j.Close()
	events, _ := os.ReadFile(filepath.Join(dir, eval.EventsFile))
	wantEvents := `{"duration_ms":0,"error_type":"agent_error","rollout_id":"a","row_index":0,"run_index":0,"source_row_index":0,"status":"failed","tokens":0}
{"duration_ms":5,"reward":1,"rollout_id":"b","row_index":1,"run_index":0,"source_row_index":7,"status":"success","tokens":12}
{"duration_ms":0,"reward":1,"rollout_id":"c","row_index":0,"run_index":0,"source_row_index":0,"status":"success","tokens":0}
`
	if string(events) != wantEvents {
		t.Fatalf("events.jsonl:\n%s\nwant\n%s", events, wantEvents)
	}
	// A kill -9 mid-write leaves a torn last line; one between the two
	// writes, a result without its event: neither was acknowledged.
	appendTo(t, filepath.Join(dir, eval.EventsFile), `{"row_index":2,"run_ind`)
	appendTo(t, path, `{"row_index":2,"run_index":0,"rollout_id":"x","status":"success","reward":1,"messages":[]}`+"\n"+`{"row_ind`)

	j, done, err = eval.OpenJournal(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(done) != 2 || done[eval.Key{Row: 0, Run: 0}].RolloutID != "c" || done[eval.Key{Row: 1, Run: 0}].SourceRowIndex != 7 {
		t.Fatalf("done = %v: want the last result per attempt, no torn line, no unacknowledged result", done)
	}
	if err := j.Append(eval.Result{RowIndex: 2, RunIndex: 0, RolloutID: "d", Status: eval.StatusSuccess}); err != nil {
		t.Fatal(err)
	}
	_ = j.Close()
	if ids := lineIDs(t, path); !reflect.DeepEqual(ids, []string{"a", "b", "c", "d"}) || !reflect.DeepEqual(lineIDs(t, filepath.Join(dir, eval.EventsFile)), ids) {
		t.Errorf("results.jsonl %v and events.jsonl %v, want a b c d in both", ids, lineIDs(t, filepath.Join(dir, eval.EventsFile)))
	}
	if _, done, err = eval.OpenJournal(path); err != nil || len(done) != 3 {
		t.Fatalf("after the torn lines were cut: %v %v", done, err)
	}
	// A bad line that is not the last is not the writer's: refused.
	bad := t.TempDir()
	write(t, bad, eval.ResultsFile, "garbage\n{\"rollout_id\":\"x\"}\n")
	if _, _, err := eval.OpenJournal(filepath.Join(bad, eval.ResultsFile)); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("err = %v", err)
	}
	write(t, bad, eval.ResultsFile, "")
	write(t, bad, eval.EventsFile, `{"row_index":0,"run_index":0,"rollout_id":"a","status":"failure"}`+"\n")
	if _, _, err := eval.OpenJournal(filepath.Join(bad, eval.ResultsFile)); err == nil || !strings.Contains(err.Error(), `status "failure"`) {
		t.Fatalf("an SDK journal with a status it does not write: err = %v", err)
	}
}

// TestJournalOlderRun: a run directory of an older osmo (results.jsonl
// with "failure", no source_row_index, no events.jsonl) resumes: failure
// reads as failed and its events.jsonl is written from it. One the SDK
// wrote (events.jsonl only) resumes too.
func TestJournalOlderRun(t *testing.T) {
	dir := t.TempDir()
	path := write(t, dir, eval.ResultsFile, `{"row_index":3,"run_index":0,"rollout_id":"old-a","status":"failure","err_category":"timeout","reward":null,"latency_ms":10,"tokens":4,"messages":[]}
{"row_index":4,"run_index":0,"rollout_id":"old-b","status":"success","reward":1,"latency_ms":12,"tokens":6,"messages":[{"role":"user","content":"q"}]}
`)
	j, done, err := eval.OpenJournal(path)
	if err != nil {
		t.Fatal(err)
	}
	_ = j.Close()
	a := done[eval.Key{Row: 3, Run: 0}]
	if a.Status != eval.StatusFailed || a.SourceRowIndex != 3 || !j.Carried(a) || done[eval.Key{Row: 4, Run: 0}].Status != eval.StatusSuccess {
		t.Fatalf("done = %+v", done)
	}
	events, _ := os.ReadFile(filepath.Join(dir, eval.EventsFile))
	if !strings.HasPrefix(string(events), `{"duration_ms":10,"error_type":"timeout","rollout_id":"old-a","row_index":3,"run_index":0,"source_row_index":3,"status":"failed","tokens":4}`+"\n") {
		t.Errorf("events.jsonl written from the results:\n%s", events)
	}

	sdk := t.TempDir()
	write(t, sdk, eval.EventsFile, `{"duration_ms":1.5,"reward":0.25,"rollout_id":"0af3","row_index":0,"run_index":1,"source_row_index":9,"status":"success","tokens":3}
{"duration_ms":2,"error_type":"grader_failed","rollout_id":"77c1","row_index":1,"run_index":0,"status":"failed"}
`)
	j, done, err = eval.OpenJournal(filepath.Join(sdk, eval.ResultsFile))
	if err != nil {
		t.Fatal(err)
	}
	_ = j.Close()
	r := done[eval.Key{Row: 0, Run: 1}]
	if len(done) != 2 || *r.Reward != 0.25 || r.SourceRowIndex != 9 || r.Tokens != 3 || r.LatencyMS != 1.5 || done[eval.Key{Row: 1, Run: 0}].ErrCategory != "grader_failed" {
		t.Fatalf("done = %+v", done)
	}
	if ids := lineIDs(t, filepath.Join(sdk, eval.ResultsFile)); !reflect.DeepEqual(ids, []string{"0af3", "77c1"}) {
		t.Errorf("results.jsonl written from the events: %v", ids)
	}
}

func appendTo(t *testing.T, path, text string) {
	t.Helper()
	fh, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = fh.WriteString(text)
	_ = fh.Close()
}

// lineIDs are the rollout_id of each line of a JSONL file.
func lineIDs(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
		var v struct {
			RolloutID string `json:"rollout_id"`
		}
		if err := json.Unmarshal([]byte(line), &v); err != nil {
			t.Fatalf("%s: %q: %v", path, line, err)
		}
		ids = append(ids, v.RolloutID)
	}
	return ids
}
