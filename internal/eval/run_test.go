package eval_test

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/osmo-rl/osmo/internal/eval"
)

// fakePolicy answers every chat completion with one message and 7 tokens.
func fakePolicy(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"42"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}`))
	}))
	t.Cleanup(srv.Close)
	return srv
}

var runOfID = regexp.MustCompile(`-n(\d+)$`)

// fakeServer is a v0.3 rollout server whose outcome is its row's label
// and the run: "pass" passes every run; "mixed" passes runs 0 and 1 and
// scores 0 after; "odd" ends run 0 with a failed grader (agent_error), run
// 1 with a removed sample, run 2 with a failed completion but a graded
// sample (0.5), and refuses run 3 with 422.
type fakeServer struct {
	// artifacts, when set, is where it writes the trajectory of a "pass"
	// row's run 0 itself, as a Python rollout server does under
	// _OSMOSIS_ROLLOUT_ARTIFACT_ROOT.
	artifacts string
	// records, when set, has it answer GET /v1/rollouts/{id} as osmo's
	// rollout server does for a "pass" row (see recordOf); otherwise, as
	// an SDK server, it has no such route.
	records    bool
	recordGets atomic.Int64
	srv        *httptest.Server
	wg         sync.WaitGroup
	mu         sync.Mutex
	ids        []string
}

func newFakeServer(t *testing.T) *fakeServer {
	t.Helper()
	f := &fakeServer{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			_, _ = w.Write([]byte(`{"status":"ok"}`))
			return
		case "/rollout/cancel":
			_, _ = w.Write([]byte(`{}`))
			return
		}
		if id, ok := strings.CutPrefix(r.URL.Path, "/v1/rollouts/"); ok && r.Method == http.MethodGet {
			f.recordGets.Add(1)
			if rec := recordOf(id); f.records && rec != nil {
				_ = json.NewEncoder(w).Encode(rec)
				return
			}
			http.NotFound(w, r)
			return
		}
		var body struct {
			RolloutID     string           `json:"rollout_id"`
			Messages      []map[string]any `json:"initial_messages"`
			Label         string           `json:"label"`
			ChatURL       string           `json:"chat_completions_url"`
			CompletionURL string           `json:"completion_callback_url"`
			GraderURL     string           `json:"grader_callback_url"`
			ControllerKey string           `json:"controller_api_key"`
			LLMKey        string           `json:"llm_api_key"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		run, _ := strconv.Atoi(runOfID.FindStringSubmatch(body.RolloutID)[1])
		if body.Label == "odd" && run == 3 {
			http.Error(w, `{"detail":"no"}`, http.StatusUnprocessableEntity)
			return
		}
		f.mu.Lock()
		f.ids = append(f.ids, body.RolloutID)
		f.mu.Unlock()
		w.WriteHeader(http.StatusAccepted)
		f.wg.Go(func() {
			f.play(t, body.RolloutID, body.Label, run, body.Messages, body.ChatURL, body.LLMKey, body.CompletionURL, body.GraderURL, body.ControllerKey)
		})
	}))
	t.Cleanup(func() { f.srv.Close(); f.wg.Wait() })
	return f
}

func post(t *testing.T, url, key string, body any) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Errorf("POST %s: %v", url, err)
		return
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("POST %s: %d", url, resp.StatusCode)
	}
}

func (f *fakeServer) play(t *testing.T, id, label string, run int, msgs []map[string]any, chatURL, llmKey, completionURL, graderURL, ctlKey string) {
	post(t, chatURL+"/chat/completions", llmKey, map[string]any{"model": "m", "messages": msgs})
	convo := append(msgs, map[string]any{"role": "assistant", "content": "42"})
	// Its llm_calls, as osmo's rollout server adds them: see sampleCalls.
	sample := map[string]any{"id": "s-" + id, "messages": convo, "reward": 1.0, "remove_sample": false, "llm_calls": sampleCalls(label, run)}
	completion := map[string]any{"status": "success", "rollout_id": id}
	grader := map[string]any{"status": "success", "rollout_id": id, "sample": sample}
	switch {
	case label == "mixed" && run >= 2:
		sample["reward"] = 0.0
	case label == "odd" && run == 0:
		grader = map[string]any{"status": "failure", "rollout_id": id, "sample": nil, "err_message": "the agent broke", "err_category": "agent_error"}
	case label == "odd" && run == 1:
		sample["remove_sample"] = true
	case label == "odd" && run == 2:
		completion = map[string]any{"status": "failure", "rollout_id": id, "err_message": "workflow raised"}
		sample["reward"] = 0.5
	}
	if f.artifacts != "" && label == "pass" && run == 0 {
		dir := filepath.Join(f.artifacts, id)
		doc := `{"schema_version":"ATIF-v1.7","session_id":"` + id + `","agent":{"name":"server","version":"1"},"steps":[{"step_id":1,"source":"user","message":"from the server"}]}`
		if err := os.MkdirAll(dir, 0o755); err != nil || os.WriteFile(filepath.Join(dir, "trajectory.json"), []byte(doc), 0o644) != nil {
			t.Errorf("writing the server's trajectory: %v", err)
		}
	}
	post(t, completionURL, ctlKey, completion)
	post(t, graderURL, ctlKey, grader)
}

func testRows() []eval.Row {
	var rows []eval.Row
	for i, label := range []string{"pass", "mixed", "odd"} {
		l := label
		rows = append(rows, eval.Row{
			Index: i, SourceIndex: 10 + i, Label: &l, Metadata: map[string]any{"kind": label},
			Messages: []map[string]any{{"role": "user", "content": "row " + label}},
		})
	}
	return rows
}

func testPlan(t *testing.T, out string, n int) eval.Plan {
	return eval.Plan{
		Rows: testRows(), N: n, BatchSize: 4, AgentTimeoutS: 30, GraderTimeoutS: 30, PassThreshold: 1,
		Output: out, ServerURL: newFakeServer(t).srv.URL, PolicyURL: fakePolicy(t).URL, Model: "m",
		RunID: "run-1", RunName: "multiply-test", DatasetName: "rows.jsonl", ModelPath: "openai/m", RolloutName: "multiply",
		TotalDatasetRows: 20,
	}
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// jsonLinesOf reads a JSONL file as objects.
func jsonLinesOf(t *testing.T, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("%s: %q: %v", path, line, err)
		}
		out = append(out, m)
	}
	return out
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-12 }

// TestRunWritesSDKFiles: a run with a known mix of passes, failures and a
// skip writes the SDK's files beside osmo's, with the SDK's words and
// numbers: events with error_type, the index with trajectory_filename,
// progress, metrics with reward_stats and pass_at_k, and a trajectory per
// attempt that has a conversation.
func TestRunWritesSDKFiles(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	p := testPlan(t, out, 4)
	srv := newFakeServer(t)
	srv.artifacts = filepath.Join(out, eval.TrialsDir)
	p.ServerURL = srv.srv.URL
	// While the run goes, metrics.json says so.
	var mu sync.Mutex
	var running map[string]any
	p.OnResult = func(eval.Result) {
		var m struct {
			EvalRun map[string]any `json:"eval_run"`
		}
		// A snapshot may be being written by another commit: the first
		// one read is kept.
		b, err := os.ReadFile(filepath.Join(out, eval.MetricsFile))
		mu.Lock()
		defer mu.Unlock()
		if err == nil && running == nil && json.Unmarshal(b, &m) == nil {
			running = m.EvalRun
		}
	}
	rep, err := eval.Run(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	if running["status"] != "running" || running["completed_at"] != nil {
		t.Errorf("eval_run during the run: %v", running)
	}
	if rep.Ran != 12 || rep.Total != 12 || rep.Pending != 0 || rep.Resumed != 0 {
		t.Fatalf("report: ran %d total %d pending %d resumed %d", rep.Ran, rep.Total, rep.Pending, rep.Resumed)
	}

	// events.jsonl: one record per attempt, the SDK's words.
	events := jsonLinesOf(t, filepath.Join(out, eval.EventsFile))
	if len(events) != 12 {
		t.Fatalf("%d events, want 12", len(events))
	}
	byKey := map[[2]int]map[string]any{}
	for _, e := range events {
		byKey[[2]int{int(e["row_index"].(float64)), int(e["run_index"].(float64))}] = e
		if e["source_row_index"].(float64) != e["row_index"].(float64)+10 || e["duration_ms"] == nil {
			t.Errorf("event %v", e)
		}
	}
	for _, tc := range []struct {
		row, run  int
		status    string
		errorType any
		reward    any
	}{
		{0, 0, "success", nil, 1.0},
		{1, 3, "success", nil, 0.0},
		{2, 0, "failed", "agent_error", nil},
		{2, 1, "skipped", nil, nil},
		{2, 2, "failed", "workflow_failed", 0.5},
		{2, 3, "failed", "rollout_protocol_error", nil},
	} {
		e := byKey[[2]int{tc.row, tc.run}]
		if e["status"] != tc.status || e["error_type"] != tc.errorType || e["reward"] != tc.reward {
			t.Errorf("row %d run %d: event %v, want status %s error_type %v reward %v", tc.row, tc.run, e, tc.status, tc.errorType, tc.reward)
		}
	}
	if e := byKey[[2]int{0, 0}]; e["tokens"] != 7.0 {
		t.Errorf("tokens of row 0 run 0: %v, want 7", e["tokens"])
	}

	// index.jsonl = summary.jsonl: row and run order, no source_row_index,
	// a trajectory for each attempt with a conversation, nothing resumed.
	index, _ := os.ReadFile(filepath.Join(out, eval.IndexFile))
	if sum, _ := os.ReadFile(filepath.Join(out, eval.SummaryLinesFile)); !bytes.Equal(index, sum) {
		t.Errorf("summary.jsonl differs from index.jsonl")
	}
	lines := jsonLinesOf(t, filepath.Join(out, eval.IndexFile))
	if len(lines) != 12 {
		t.Fatalf("%d index lines", len(lines))
	}
	for i, l := range lines {
		if l["row_index"] != float64(i/4) || l["run_index"] != float64(i%4) {
			t.Errorf("index line %d: %v, want row %d run %d", i, l, i/4, i%4)
		}
		_, hasSource := l["source_row_index"]
		_, resumed := l["resumed"]
		wantTraj := !(i == 11) // the refused start has no conversation
		if hasSource || resumed || (l["trajectory_filename"] == "trajectory.json") != wantTraj {
			t.Errorf("index line %d: %v", i, l)
		}
	}
	if first := strings.SplitN(string(index), "\n", 2)[0]; !strings.HasPrefix(first, `{"row_index":0,"run_index":0,"rollout_id":"eval-`) || !strings.Contains(first, `"trajectory_filename":"trajectory.json","status":"success","reward":1,"tokens":7,"duration_ms":`) {
		t.Errorf("first index line %s", first)
	}

	var progress map[string]any
	readJSON(t, filepath.Join(out, eval.ProgressFile), &progress)
	if !reflect.DeepEqual(progress, map[string]any{"total_runs": 12.0, "sampled_rows": 3.0, "total_dataset_rows": 20.0}) {
		t.Errorf("progress.json %v", progress)
	}

	var metrics struct {
		EvalRun map[string]any       `json:"eval_run"`
		Summary eval.PlatformSummary `json:"summary"`
	}
	readJSON(t, filepath.Join(out, eval.MetricsFile), &metrics)
	run := metrics.EvalRun
	if run["id"] != "run-1" || run["status"] != "finished" || run["name"] != "multiply-test" || run["dataset_name"] != "rows.jsonl" ||
		run["model_name"] != "openai/m" || run["rollout_name"] != "multiply" || run["completed_at"] == nil || run["duration_ms"].(float64) <= 0 ||
		!regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$`).MatchString(run["started_at"].(string)) {
		t.Errorf("eval_run %v", run)
	}
	// 12 attempts, 1 skipped; rewards 1×4, 1,1,0,0, and the failed
	// completion's 0.5: 9 graded, 6 passed, 3 failed.
	s := metrics.Summary
	rewards := []float64{1, 1, 1, 1, 1, 1, 0, 0, 0.5}
	mean := 6.5 / 9
	var sq float64
	for _, r := range rewards {
		sq += (r - mean) * (r - mean)
	}
	if s.TotalSamples != 12 || s.CompletedSamples != 11 || s.Graded != 9 || s.Passed != 6 || s.Failed != 3 || s.Skipped != 1 ||
		!near(s.PassRate, 6.0/11) || s.TokensUsed != 7*11 || s.NRuns != 4 || s.RewardStats == nil ||
		!near(s.RewardStats.Mean, mean) || s.RewardStats.Median != 1 || !near(s.RewardStats.Std, math.Sqrt(sq/9)) || s.RewardStats.Min != 0 || s.RewardStats.Max != 1 {
		t.Errorf("metrics summary %+v reward_stats %+v", s, s.RewardStats)
	}
	// pass@1: (1 + 0.5 + 0)/3; pass@2: (1 + 5/6 + 0)/3; pass@4: rows 0 and 1
	// only (row 2 has 3 scored attempts): (1 + 1)/2.
	want := []eval.PassAtKPoint{{K: 1, Value: 0.5}, {K: 2, Value: 11.0 / 18}, {K: 4, Value: 1}}
	if len(s.PassAtK) != 3 {
		t.Fatalf("pass_at_k %+v", s.PassAtK)
	}
	for i, pt := range s.PassAtK {
		if pt.K != want[i].K || !near(pt.Value, want[i].Value) {
			t.Errorf("pass_at_k[%d] = %+v, want %+v", i, pt, want[i])
		}
	}
	// summary.json: the same, and osmo's fields.
	var summary eval.Summary
	readJSON(t, filepath.Join(out, eval.SummaryFile), &summary)
	if !reflect.DeepEqual(summary.PlatformSummary, s) || summary.ErrorsByCategory["rollout_protocol_error"] != 1 || summary.ErrorsByCategory["workflow_failed"] != 1 {
		t.Errorf("summary.json %+v", summary)
	}

	// trajectories: the ATIF document, in rollout_trials and its copy.
	var traj map[string]any
	readJSON(t, filepath.Join(out, eval.TrajectoriesDir, "row_1_run_2.json"), &traj)
	id := byKey[[2]int{1, 2}]["rollout_id"].(string)
	steps, _ := traj["steps"].([]any)
	osm := traj["extra"].(map[string]any)["osmosis"].(map[string]any)
	if traj["schema_version"] != "ATIF-v1.7" || traj["session_id"] != id || len(steps) != 2 || osm["rollout_id"] != id || osm["label"] != "mixed" || osm["reward"] != 0.0 ||
		steps[1].(map[string]any)["source"] != "agent" || steps[1].(map[string]any)["message"] != "42" {
		t.Errorf("trajectory %v", traj)
	}
	canonical, _ := os.ReadFile(filepath.Join(out, eval.TrialsDir, id, "trajectory.json"))
	if proj, _ := os.ReadFile(filepath.Join(out, eval.TrajectoriesDir, "row_1_run_2.json")); !bytes.Equal(canonical, proj) {
		t.Errorf("the copy differs from rollout_trials/%s/trajectory.json", id)
	}
	// The trajectory the server wrote is the one.
	if b, _ := os.ReadFile(filepath.Join(out, eval.TrajectoriesDir, "row_0_run_0.json")); !strings.Contains(string(b), "from the server") {
		t.Errorf("row 0 run 0's trajectory is not the server's:\n%s", b)
	}
	if _, err := os.Stat(filepath.Join(out, eval.TrajectoriesDir, "row_2_run_3.json")); !os.IsNotExist(err) {
		t.Errorf("a trajectory for the refused start: %v", err)
	}

	// results.jsonl: the same words, and source_row_index.
	results := jsonLinesOf(t, filepath.Join(out, eval.ResultsFile))
	for _, r := range results {
		if r["status"] == "failure" || r["source_row_index"] != r["row_index"].(float64)+10 {
			t.Errorf("result %v", r)
		}
	}
	for _, name := range []string{eval.ResultsFile, eval.EventsFile, eval.IndexFile, eval.MetricsFile, eval.ProgressFile, eval.SummaryFile, eval.ReportFile, filepath.Join(eval.TrajectoriesDir, "row_0_run_0.json")} {
		if fi, err := os.Stat(filepath.Join(out, name)); err != nil || fi.Mode().Perm() != 0o644 {
			t.Errorf("%s: %v %v, want 0644", name, err, fi.Mode())
		}
	}
	report, _ := os.ReadFile(filepath.Join(out, eval.ReportFile))
	for _, w := range []string{"pass@4", "st-failed", "reward median"} {
		if !strings.Contains(string(report), w) {
			t.Errorf("report.html has no %q", w)
		}
	}
	var table strings.Builder
	_ = rep.Summary.WriteTable(&table)
	if !strings.Contains(table.String(), "k=1 0.500 · k=2 0.611 · k=4 1.000") || !strings.Contains(table.String(), "median 1") {
		t.Errorf("table:\n%s", table.String())
	}
}

// TestRunResumes: a run killed between and within its journal writes
// resumes consistently: only the attempts without an event run again, the
// carried ones are resumed in the index, and results.jsonl and
// events.jsonl hold the same attempts in the same order. --retry-failed
// then reruns the failed and the skipped attempts under new ids.
func TestRunResumes(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	if _, err := eval.Run(context.Background(), testPlan(t, out, 2)); err != nil {
		t.Fatal(err)
	}
	resultsPath, eventsPath := filepath.Join(out, eval.ResultsFile), filepath.Join(out, eval.EventsFile)
	all := lineIDs(t, eventsPath)
	if len(all) != 6 || !reflect.DeepEqual(lineIDs(t, resultsPath), all) {
		t.Fatalf("events %v results %v", all, lineIDs(t, resultsPath))
	}
	// The kill: three acknowledged results, a fourth written to
	// results.jsonl only, and a torn event.
	keep := func(path string, n int, tail string) {
		data, _ := os.ReadFile(path)
		lines := strings.SplitAfter(string(data), "\n")
		if err := os.WriteFile(path, []byte(strings.Join(lines[:n], "")+tail), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	keep(resultsPath, 4, "")
	keep(eventsPath, 3, `{"duration_ms":1,"rollout_id":"`)

	rep, err := eval.Run(context.Background(), testPlan(t, out, 2))
	if err != nil {
		t.Fatal(err)
	}
	if rep.Ran != 3 || rep.Resumed != 3 || len(rep.Results) != 6 {
		t.Fatalf("ran %d resumed %d results %d, want 3, 3, 6", rep.Ran, rep.Resumed, len(rep.Results))
	}
	ids := lineIDs(t, eventsPath)
	if len(ids) != 6 || !reflect.DeepEqual(ids[:3], all[:3]) || !reflect.DeepEqual(lineIDs(t, resultsPath), ids) {
		t.Errorf("after the resume: events %v results %v (first run %v)", ids, lineIDs(t, resultsPath), all)
	}
	carried := map[string]bool{all[0]: true, all[1]: true, all[2]: true}
	for _, l := range jsonLinesOf(t, filepath.Join(out, eval.IndexFile)) {
		if (l["resumed"] == true) != carried[l["rollout_id"].(string)] {
			t.Errorf("index line %v: resumed should be %v", l, carried[l["rollout_id"].(string)])
		}
	}
	for row := range 3 {
		for run := range 2 {
			if _, err := os.Stat(filepath.Join(out, eval.TrajectoriesDir, "row_"+strconv.Itoa(row)+"_run_"+strconv.Itoa(run)+".json")); err != nil {
				t.Errorf("trajectory of row %d run %d: %v", row, run, err)
			}
		}
	}

	// --retry-failed: row 2's failed run 0 and skipped run 1 run again.
	before := map[[2]int]string{}
	for _, r := range rep.Results {
		before[[2]int{r.RowIndex, r.RunIndex}] = r.RolloutID
	}
	p := testPlan(t, out, 2)
	p.RetryFailed = true
	rep, err = eval.Run(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Ran != 2 || rep.Resumed != 4 {
		t.Fatalf("--retry-failed ran %d resumed %d, want 2 and 4", rep.Ran, rep.Resumed)
	}
	for _, r := range rep.Results {
		rerun := r.RowIndex == 2
		if (before[[2]int{r.RowIndex, r.RunIndex}] != r.RolloutID) != rerun {
			t.Errorf("row %d run %d: rollout %s (was %s)", r.RowIndex, r.RunIndex, r.RolloutID, before[[2]int{r.RowIndex, r.RunIndex}])
		}
	}
	if ids := lineIDs(t, eventsPath); len(ids) != 8 || !reflect.DeepEqual(lineIDs(t, resultsPath), ids) {
		t.Errorf("events %v results %v", ids, lineIDs(t, resultsPath))
	}
	for _, l := range jsonLinesOf(t, filepath.Join(out, eval.IndexFile)) {
		if (l["resumed"] == true) == (l["row_index"] == 2.0) {
			t.Errorf("index line %v after --retry-failed", l)
		}
	}
	var summary eval.Summary
	readJSON(t, filepath.Join(out, eval.SummaryFile), &summary)
	if summary.TotalSamples != 6 || summary.Failed != 1 || summary.Skipped != 1 {
		t.Errorf("summary after --retry-failed %+v", summary)
	}
}

// TestRerunKeepsWallTime: rerunning a finished run runs nothing and keeps
// the wall time the run took; a resume that runs attempts adds its own.
func TestRerunKeepsWallTime(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	wallS := func() float64 {
		var s eval.Summary
		readJSON(t, filepath.Join(out, eval.SummaryFile), &s)
		return s.WallS
	}
	if _, err := eval.Run(context.Background(), testPlan(t, out, 2)); err != nil {
		t.Fatal(err)
	}
	first := wallS()
	if first <= 0 {
		t.Fatalf("wall_s after the run: %v", first)
	}
	rep, err := eval.Run(context.Background(), testPlan(t, out, 2))
	if err != nil {
		t.Fatal(err)
	}
	if rep.Ran != 0 || rep.Summary.WallS != first || wallS() != first {
		t.Fatalf("rerun: ran %d, wall_s %v in the report and %v on disk, want 0 and %v", rep.Ran, rep.Summary.WallS, wallS(), first)
	}
	p := testPlan(t, out, 2)
	p.RetryFailed = true
	if rep, err = eval.Run(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	if rep.Ran == 0 || wallS() <= first {
		t.Errorf("--retry-failed: ran %d, wall_s %v, want more than %v", rep.Ran, wallS(), first)
	}
}
