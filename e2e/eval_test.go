//go:build unix

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/eval"
	"github.com/osmo-rl/osmo/internal/mockllm"
)

// countingPolicy is the mock policy behind a counter: the calls of every
// rollout, and the most calls it held at once.
type countingPolicy struct {
	srv      *httptest.Server
	mu       sync.Mutex
	inFlight int
	peak     int
	calls    map[string]int // by x-rollout-id ("" for the eval's check)
}

func newCountingPolicy(t *testing.T, latency time.Duration) *countingPolicy {
	t.Helper()
	m, err := mockllm.New(mockllm.Options{Latency: latency, Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	p := &countingPolicy{calls: map[string]int{}}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.inFlight++
		p.peak = max(p.peak, p.inFlight)
		p.calls[r.Header.Get("X-Rollout-Id")]++
		p.mu.Unlock()
		defer func() { p.mu.Lock(); p.inFlight--; p.mu.Unlock() }()
		m.ServeHTTP(w, r)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *countingPolicy) snapshot() (map[string]int, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.calls), p.peak
}

// evalFiles writes a TOML for the multiply workflow over the shipped
// 40-row dataset (in the format of ext) against baseURL.
func evalFiles(t *testing.T, ext, baseURL string, batch int) string {
	t.Helper()
	dir := t.TempDir()
	data, err := os.ReadFile(filepath.Join("..", "examples", "eval", "multiply"+ext))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "rows"+ext), data, 0o644); err != nil {
		t.Fatal(err)
	}
	toml := fmt.Sprintf(`[experiment]
rollout = "multiply"
model_path = "openai/mock-policy"
dataset = "rows%s"

[evaluation]
n = 2
batch_size = %d
agent_workflow_timeout_s = 60
grader_timeout_s = 30

[llm]
base_url = %q
api_key_env = "OSMO_TEST_EVAL_KEY"
`, ext, batch, baseURL)
	path := filepath.Join(dir, "multiply.toml")
	if err := os.WriteFile(path, []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// runEval runs `osmo eval run` to its end and returns its exit code and
// output.
func runEval(t *testing.T, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, osmoBin, append([]string{"eval", "run"}, args...)...)
	cmd.Env = append(os.Environ(), "OSMO_TEST_EVAL_KEY=k-upstream")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("osmo eval run: %v\n%s", err, out)
	}
	return cmd.ProcessState.ExitCode(), string(out)
}

// runEvalSplit runs `osmo eval run` to its end and returns its exit code,
// stdout and stderr.
func runEvalSplit(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, osmoBin, append([]string{"eval", "run"}, args...)...)
	cmd.Env = append(os.Environ(), "OSMO_TEST_EVAL_KEY=k-upstream")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("osmo eval run: %v\n%s", err, stderr.String())
	}
	return cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()
}

func readResults(t *testing.T, dir string) []eval.Result {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, eval.ResultsFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []eval.Result
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 64<<20)
	for sc.Scan() {
		var r eval.Result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("results.jsonl: %v", err)
		}
		out = append(out, r)
	}
	return out
}

// sdkLine is a line of events.jsonl or index.jsonl.
type sdkLine struct {
	RowIndex           int    `json:"row_index"`
	RunIndex           int    `json:"run_index"`
	RolloutID          string `json:"rollout_id"`
	Status             string `json:"status"`
	TrajectoryFilename string `json:"trajectory_filename"`
	Resumed            bool   `json:"resumed"`
}

func readLines(t *testing.T, path string) []sdkLine {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []sdkLine
	for line := range strings.Lines(string(data)) {
		if !strings.HasSuffix(line, "\n") {
			break // torn by the kill
		}
		var l sdkLine
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		out = append(out, l)
	}
	return out
}

func readEvents(t *testing.T, dir string) []sdkLine {
	return readLines(t, filepath.Join(dir, eval.EventsFile))
}

func readIndex(t *testing.T, dir string) []sdkLine {
	return readLines(t, filepath.Join(dir, eval.IndexFile))
}

func readSummary(t *testing.T, dir string) eval.Summary {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, eval.SummaryFile))
	if err != nil {
		t.Fatal(err)
	}
	var s eval.Summary
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	s.WallS = 0
	return s
}

// TestEvalRun is the loop a user lives in: an eval of 40 rows, twice each,
// against an OpenAI-compatible model on loopback writes 80 results whose
// counts match its summary, with at most batch_size rollouts in flight
// (and more than one at a time); the same dataset as CSV, and through a
// separately started `osmo serve`, give the same summary; a rerun of the
// finished eval makes no model call.
func TestEvalRun(t *testing.T) {
	policy := newCountingPolicy(t, 20*time.Millisecond)
	const batch = 4
	toml := evalFiles(t, ".jsonl", policy.srv.URL+"/v1", batch)
	out := filepath.Join(t.TempDir(), "out")
	code, output := runEval(t, toml, "--output", filepath.Dir(out), "--name", filepath.Base(out))
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, output)
	}
	results := readResults(t, out)
	summary := readSummary(t, out)
	seen := map[eval.Key]bool{}
	for _, r := range results {
		seen[r.Key()] = true
		if r.Status != eval.StatusSuccess || r.Reward == nil || *r.Reward != 1 || len(r.Messages) < 3 || r.Tokens == 0 {
			t.Errorf("result %+v", r)
		}
	}
	if len(results) != 80 || len(seen) != 80 {
		t.Fatalf("%d results for %d attempts, want 80 of 80", len(results), len(seen))
	}
	if summary.TotalSamples != 80 || summary.Passed != 80 || summary.Graded != 80 || summary.PassRate != 1 ||
		summary.NRuns != 2 || !reflect.DeepEqual(summary.PassAtK, []eval.PassAtKPoint{{K: 1, Value: 1}, {K: 2, Value: 1}}) || summary.TokensUsed == 0 {
		t.Errorf("summary %+v", summary)
	}
	calls, peak := policy.snapshot()
	if peak > batch || peak < 2 {
		t.Errorf("the policy held %d calls at once, want 2..%d (batch_size)", peak, batch)
	}
	if !strings.Contains(output, "pass rate") || !strings.Contains(output, "100.0%") {
		t.Errorf("the summary table is missing:\n%s", output)
	}
	report, err := os.ReadFile(filepath.Join(out, eval.ReportFile))
	if err != nil || !strings.Contains(string(report), "What is") || !strings.Contains(string(report), "<svg") {
		t.Errorf("report.html: %v, %d bytes", err, len(report))
	}

	t.Run("a rerun makes no model call", func(t *testing.T) {
		code, output := runEval(t, toml, "--output", filepath.Dir(out), "--name", filepath.Base(out))
		after, _ := policy.snapshot()
		if code != 0 || !reflect.DeepEqual(calls, after) || !strings.Contains(output, "nothing ran") {
			t.Errorf("exit %d, calls before %d after %d:\n%s", code, total(calls), total(after), output)
		}
		if n := len(readResults(t, out)); n != 80 {
			t.Errorf("%d results after the rerun, want 80", n)
		}
	})
	t.Run("--json prints the result alone on stdout", func(t *testing.T) {
		code, stdout, stderr := runEvalSplit(t, toml, "--output", filepath.Dir(out), "--name", filepath.Base(out), "--json")
		var got struct {
			SchemaVersion int    `json:"schema_version"`
			Status        string `json:"status"`
			Operation     string `json:"operation"`
			Resource      struct {
				OutputPath     string               `json:"output_path"`
				TotalWorkItems int                  `json:"total_work_items"`
				Dispatched     int                  `json:"dispatched"`
				Succeeded      int                  `json:"succeeded"`
				Resumed        int                  `json:"resumed"`
				Pending        int                  `json:"pending"`
				Metrics        eval.PlatformSummary `json:"metrics"`
				Summary        eval.Summary         `json:"summary"`
				FailedRows     []any                `json:"failed_rows"`
			} `json:"resource"`
		}
		if err := json.Unmarshal([]byte(stdout), &got); err != nil || code != 0 || strings.Count(stdout, "\n") != 1 {
			t.Fatalf("exit %d, stdout not one JSON object (%v):\n%s\nstderr:\n%s", code, err, stdout, stderr)
		}
		r := got.Resource
		if got.SchemaVersion != 1 || got.Status != "success" || got.Operation != "eval.run" || r.OutputPath != out || r.TotalWorkItems != 80 ||
			r.Dispatched != 0 || r.Succeeded != 80 || r.Resumed != 80 || r.Pending != 0 || len(r.FailedRows) != 0 ||
			!reflect.DeepEqual(r.Metrics, summary.PlatformSummary) || r.Summary.ErrorsByCategory == nil {
			t.Errorf("--json result %+v", got)
		}
	})
	t.Run("the same rows as CSV", func(t *testing.T) {
		csvOut := filepath.Join(t.TempDir(), "out")
		if code, output := runEval(t, evalFiles(t, ".csv", policy.srv.URL+"/v1", batch), "--output", filepath.Dir(csvOut), "--name", filepath.Base(csvOut)); code != 0 {
			t.Fatalf("exit %d:\n%s", code, output)
		}
		if got := readSummary(t, csvOut); !reflect.DeepEqual(got, summary) {
			t.Errorf("CSV summary %+v\nJSONL summary %+v", got, summary)
		}
	})
	t.Run("against a separately started osmo serve", func(t *testing.T) {
		srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", "multiply", "--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
		base := addrs["http"]
		waitHTTP(t, srv, base+"/health")
		srvOut := filepath.Join(t.TempDir(), "out")
		if code, output := runEval(t, toml, "--output", filepath.Dir(srvOut), "--name", filepath.Base(srvOut), "--server", base, "--server-key", serverKey); code != 0 {
			t.Fatalf("exit %d:\n%s\nserver:\n%s", code, output, srv.Output())
		}
		if got := readSummary(t, srvOut); !reflect.DeepEqual(got, summary) {
			t.Errorf("--server summary %+v\nin-process summary %+v", got, summary)
		}
	})
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestEvalResumesAfterKill: an eval killed with SIGKILL halfway and run
// again ends with exactly one result per sample, and the model sees no
// call for a sample that had finished.
func TestEvalResumesAfterKill(t *testing.T) {
	policy := newCountingPolicy(t, 80*time.Millisecond)
	toml := evalFiles(t, ".jsonl", policy.srv.URL+"/v1", 4)
	out := filepath.Join(t.TempDir(), "out")
	cmd := exec.Command(osmoBin, "eval", "run", toml, "--output", filepath.Dir(out), "--name", filepath.Base(out))
	// A TMPDIR of the test's: the killed process leaves its embedded
	// state server's directory behind.
	cmd.Env = append(os.Environ(), "OSMO_TEST_EVAL_KEY=k-upstream", "TMPDIR="+t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(out, eval.ResultsFile))
		if n := strings.Count(string(b), "\n"); n >= 30 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	// What a resume trusts is events.jsonl: a result line whose event the
	// kill cut off was never acknowledged, and runs again.
	first := readEvents(t, out)
	if len(first) == 0 || len(first) >= 80 {
		t.Fatalf("%d results when killed, want some but not all", len(first))
	}
	finished := map[eval.Key]bool{}
	carried := map[string]bool{}
	for _, e := range first {
		finished[eval.Key{Row: e.RowIndex, Run: e.RunIndex}] = true
		carried[e.RolloutID] = true
	}
	before, _ := policy.snapshot()

	if code, output := runEval(t, toml, "--output", filepath.Dir(out), "--name", filepath.Base(out)); code != 0 {
		t.Fatalf("rerun: exit %d:\n%s", code, output)
	}
	results := readResults(t, out)
	seen := map[eval.Key]int{}
	for _, r := range results {
		seen[r.Key()]++
	}
	if len(seen) != 80 || len(results) != 80 {
		t.Errorf("%d results for %d attempts after the rerun, want exactly one for each of 80", len(results), len(seen))
	}
	// results.jsonl and events.jsonl hold the same attempts in the same
	// order; the index marks the carried ones resumed; every attempt has
	// its trajectory.
	events := readEvents(t, out)
	if len(events) != 80 {
		t.Errorf("%d events after the rerun, want 80", len(events))
	}
	for i, e := range events {
		if i < len(results) && results[i].RolloutID != e.RolloutID {
			t.Errorf("line %d: result %s, event %s", i+1, results[i].RolloutID, e.RolloutID)
			break
		}
	}
	index := readIndex(t, out)
	if len(index) != 80 {
		t.Errorf("%d index lines, want 80", len(index))
	}
	for _, l := range index {
		if l.Resumed != carried[l.RolloutID] || l.TrajectoryFilename != "trajectory.json" {
			t.Errorf("index line %+v: resumed should be %v", l, carried[l.RolloutID])
		}
		if _, err := os.Stat(filepath.Join(out, eval.TrajectoriesDir, fmt.Sprintf("row_%d_run_%d.json", l.RowIndex, l.RunIndex))); err != nil {
			t.Error(err)
		}
	}
	var metrics struct {
		EvalRun struct{ Status string } `json:"eval_run"`
	}
	if b, err := os.ReadFile(filepath.Join(out, eval.MetricsFile)); err != nil || json.Unmarshal(b, &metrics) != nil || metrics.EvalRun.Status != "finished" {
		t.Errorf("metrics.json: %v %+v", err, metrics)
	}
	after, _ := policy.snapshot()
	for id, n := range after {
		if n == before[id] || id == "" {
			continue
		}
		var nonce string
		var row, run int
		if _, err := fmt.Sscanf(strings.ReplaceAll(id, "-", " "), "eval %s r%d n%d", &nonce, &row, &run); err != nil {
			t.Errorf("rollout id %q: %v", id, err)
			continue
		}
		if finished[eval.Key{Row: row, Run: run}] && before[id] == 0 {
			t.Errorf("the rerun called the model for row %d run %d, which had finished", row, run)
		}
	}
}

// TestEvalPending: a rollout server that answers POST /rollout with 503
// (restarting, say) stops the run without a result for any attempt: they
// stay pending for a rerun, and the exit code is 1; --json says partial.
func TestEvalPending(t *testing.T) {
	policy := newCountingPolicy(t, 0)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			_, _ = w.Write([]byte(`{"status":"ok"}`))
			return
		}
		http.Error(w, "restarting", http.StatusServiceUnavailable)
	}))
	t.Cleanup(srv.Close)
	toml := evalFiles(t, ".jsonl", policy.srv.URL+"/v1", 4)
	out := filepath.Join(t.TempDir(), "out")
	code, stdout, stderr := runEvalSplit(t, toml, "--output", filepath.Dir(out), "--name", filepath.Base(out), "--server", srv.URL, "--json")
	var got struct {
		Status   string `json:"status"`
		Resource struct {
			Pending int    `json:"pending"`
			Error   string `json:"error"`
		} `json:"resource"`
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil || code != 1 || got.Status != "partial" || got.Resource.Pending != 80 || !strings.Contains(got.Resource.Error, "503") {
		t.Fatalf("exit %d (want 1), result %+v (%v):\n%s\nstderr:\n%s", code, got, err, stdout, stderr)
	}
	if b, _ := os.ReadFile(filepath.Join(out, eval.EventsFile)); len(b) != 0 {
		t.Errorf("events.jsonl holds %q: a refused start is no result of the row", b)
	}
}

// TestEvalBadInput: what cannot run is refused before any rollout runs,
// with a clear message and exit code 2.
func TestEvalBadInput(t *testing.T) {
	policy := newCountingPolicy(t, 0)
	dir := t.TempDir()
	good := func(dataset string) string {
		return fmt.Sprintf("[experiment]\nrollout = \"multiply\"\nmodel_path = \"openai/m\"\ndataset = %q\n[llm]\nbase_url = %q\n", dataset, policy.srv.URL+"/v1")
	}
	for _, tc := range []struct {
		name, toml, dataset, want string
		args                      []string
	}{
		{"no user_prompt", good("d.jsonl"), `{"prompt":"hi","ground_truth":"1"}`, "user_prompt: missing", nil},
		{"metadata not an object", good("d.jsonl"), "{\"user_prompt\":\"q\"}\n{\"user_prompt\":\"q\",\"metadata\":\"[1]\"}", "row 1: metadata: must be a JSON object", nil},
		{"empty dataset", good("d.jsonl"), "", "has no rows", nil},
		{"TOML error", "[experiment]\nrollout = multiply\n", "", "multiply.toml:2", nil},
		{"unknown workflow", strings.Replace(good("d.jsonl"), `"multiply"`, `"nope"`, 1), `{"user_prompt":"q"}`, `unknown workflow "nope"`, nil},
		{"unreachable model", strings.Replace(good("d.jsonl"), policy.srv.URL, "http://127.0.0.1:1", 1), `{"user_prompt":"q"}`, "http://127.0.0.1:1/v1/chat/completions did not answer", nil},
		{"n below 1", good("d.jsonl") + "[evaluation]\nn = 0\n", `{"user_prompt":"q"}`, "evaluation.n: must be a positive integer", nil},
		{"--n below 1", good("d.jsonl"), `{"user_prompt":"q"}`, "--n: must be at least 1", []string{"--n", "-1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sub := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_"))
			_ = os.MkdirAll(sub, 0o755)
			_ = os.WriteFile(filepath.Join(sub, "d.jsonl"), []byte(tc.dataset), 0o644)
			toml := filepath.Join(sub, "multiply.toml")
			_ = os.WriteFile(toml, []byte(tc.toml), 0o644)
			code, output := runEval(t, append([]string{toml}, tc.args...)...)
			if code != 2 || !strings.Contains(output, tc.want) {
				t.Errorf("exit %d, want 2 with %q:\n%s", code, tc.want, output)
			}
		})
	}
	if calls, _ := policy.snapshot(); total(calls) != 0 {
		t.Errorf("refused evals made %d model calls", total(calls))
	}
}

// TestEvalInterrupt: Ctrl-C stops admitting, cancels what runs on the
// server, keeps what finished, and exits 130.
func TestEvalInterrupt(t *testing.T) {
	policy := newCountingPolicy(t, 100*time.Millisecond)
	toml := evalFiles(t, ".jsonl", policy.srv.URL+"/v1", 4)
	out := filepath.Join(t.TempDir(), "out")
	cmd := exec.Command(osmoBin, "eval", "run", toml, "--output", filepath.Dir(out), "--name", filepath.Base(out))
	cmd.Env = append(os.Environ(), "OSMO_TEST_EVAL_KEY=k-upstream")
	var buf strings.Builder
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		b, _ := os.ReadFile(filepath.Join(out, eval.ResultsFile))
		if strings.Count(string(b), "\n") >= 4 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = cmd.Process.Signal(os.Interrupt)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("osmo eval did not stop within 30s of Ctrl-C:\n%s", buf.String())
	}
	if code := cmd.ProcessState.ExitCode(); code != 130 {
		t.Fatalf("exit %d, want 130:\n%s", code, buf.String())
	}
	got := readResults(t, out)
	if len(got) == 0 || len(got) >= 80 {
		t.Errorf("%d results kept, want those that finished", len(got))
	}
	if s := readSummary(t, out); s.TotalSamples != len(got) {
		t.Errorf("summary of %d samples for %d results", s.TotalSamples, len(got))
	}
}
