//go:build unix

package osmosisserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/osmotest"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/workflows/osmosisserver"
)

// fixture is the example workspace's stand-in rollout server.
const fixture = "../../examples/osmosis-workspace/rollouts/multiply"

func TestMain(m *testing.M) {
	if _, err := exec.LookPath("python3"); err != nil {
		fmt.Println("skipping: python3 is not on PATH")
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// policy is the mock policy behind a recorder of the calls it was sent.
type policy struct {
	url string
	mu  sync.Mutex
	got []http.Header
}

func newPolicy(t *testing.T) *policy {
	m, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := &policy{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.got = append(p.got, r.Header.Clone())
		p.mu.Unlock()
		// The endpoint's path names the rollout and sample, as osmo's proxy's does.
		r.URL.Path = "/v1/chat/completions"
		m.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	p.url = srv.URL
	return p
}

func (p *policy) calls() []http.Header {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]http.Header(nil), p.got...)
}

// runtime is the rollout service's side of a Rollout.
type runtime struct {
	p   *policy
	id  string
	log *slog.Logger
}

func (rt *runtime) Endpoint(sampleID string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: rt.p.url + "/r/" + rt.id + "/s/" + sampleID + "/v1", APIKey: "key-" + rt.id}
}
func (rt *runtime) Logger() *slog.Logger                 { return rt.log }
func (rt *runtime) LogEvent(string, map[string]any)      {}
func (rt *runtime) RecordToolCall(string, time.Duration) {}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func startHost(t *testing.T, cfg osmosisserver.Config) (*osmosisserver.Host, *logtest.Buffer) {
	t.Helper()
	out := &logtest.Buffer{}
	if cfg.Dir == "" {
		cfg.Dir = fixture
	}
	cfg.Output = out
	cfg.Logger = slog.New(slog.NewTextHandler(tWriter{t}, nil))
	cfg.StopGrace = 2 * time.Second
	cfg.ReadyTimeout = 20 * time.Second
	h, err := osmosisserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pids := h.PIDs()
		if err := h.Stop(context.Background()); err != nil {
			t.Errorf("Stop: %v", err)
		}
		for _, pid := range pids {
			if pid != 0 && !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
				t.Errorf("server process %d outlived Stop", pid)
			}
		}
		if t.Failed() {
			t.Logf("servers' output:\n%s", out.String())
		}
	})
	return h, out
}

var secretEnv = map[string]string{"MULTIPLY_SECRET": "s3cret", "MULTIPLY_GREETING": "hello"}

// run runs the workflow for one rollout.
func run(ctx context.Context, t *testing.T, h *osmosisserver.Host, p *policy, id, prompt string, label *string) (*osmo.Rollout, error) {
	return runLogged(ctx, tWriter{t}, h, p, id, prompt, label)
}

// runLogged is run with the rollout's log going to w.
func runLogged(ctx context.Context, w io.Writer, h *osmosisserver.Host, p *policy, id, prompt string, label *string) (*osmo.Rollout, error) {
	r := osmotest.NewRollout(id, &runtime{p: p, id: id, log: slog.New(slog.NewTextHandler(w, nil)).With("rollout_id", id)})
	err := osmotest.Run(ctx, h.Workflow(), r, &osmotest.Input{
		RolloutID: id,
		Prompt:    []osmo.Message{{"role": "user", "content": prompt}},
		Label:     label,
	})
	return r, err
}

type result struct {
	msgs   []osmo.Message
	extra  map[string]any
	reward *float64
	finish string
}

func sampleOf(t *testing.T, r *osmo.Rollout) result {
	t.Helper()
	src := osmotest.Sources(r)
	if len(src) != 1 {
		t.Fatalf("%d sample sources, want 1", len(src))
	}
	msgs, err := osmotest.Messages(src[0].Source)
	if err != nil {
		t.Fatal(err)
	}
	res := src[0].Source.(osmo.SampleResult)
	return result{msgs: msgs, extra: src[0].Source.(osmo.SampleExtras).SampleExtraFields(), reward: res.SampleAgentReward(), finish: res.SampleFinishReason()}
}

func ptr(s string) *string { return &s }

func within(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestRolloutsSucceed: rollouts spread over two processes; each sample is
// the server's conversation (the multiply tool call, its result and the
// answer), with the [env] greeting in its extra fields and the server's
// reward (1 for the right label, 0 for a wrong one); every LLM call bore
// the endpoint's key and the Osmosis headers.
func TestRolloutsSucceed(t *testing.T) {
	p := newPolicy(t)
	h, _ := startHost(t, osmosisserver.Config{Procs: 2, Env: secretEnv, Secrets: []string{"s3cret"}})
	if pids := h.PIDs(); len(pids) != 2 || pids[0] == 0 || pids[1] == 0 || pids[0] == pids[1] {
		t.Fatalf("PIDs = %v", pids)
	}
	const n = 6
	var wg sync.WaitGroup
	rs, errs := make([]*osmo.Rollout, n), make([]error, n)
	for i := range n {
		wg.Go(func() {
			label := "42"
			if i%2 == 1 {
				label = "41"
			}
			rs[i], errs[i] = run(within(t, 30*time.Second), t, h, p, fmt.Sprintf("ok-%d", i), "What is 6 times 7?", &label)
		})
	}
	wg.Wait()
	pids := map[any]bool{}
	for i := range n {
		if errs[i] != nil {
			t.Errorf("rollout %d: %v", i, errs[i])
			continue
		}
		s := sampleOf(t, rs[i])
		want := 1.0
		if i%2 == 1 {
			want = 0
		}
		if s.reward == nil || *s.reward != want || s.finish != "stop" || len(s.msgs) != 4 || s.extra["greeting"] != "hello" {
			t.Errorf("rollout %d: %+v", i, s)
		}
		if len(s.msgs) == 4 && (s.msgs[1]["tool_calls"] == nil || s.msgs[2]["content"] != "42") {
			t.Errorf("rollout %d: no multiply tool call: %v", i, s.msgs)
		}
		pids[s.extra["server_pid"]] = true
	}
	if len(pids) != 2 {
		t.Errorf("rollouts ran on %d processes, want both", len(pids))
	}
	calls := p.calls()
	if len(calls) != 2*n {
		t.Errorf("%d LLM calls, want %d", len(calls), 2*n)
	}
	for _, c := range calls {
		id := c.Get("X-Rollout-Id")
		if c.Get("Authorization") != "Bearer key-"+id || c.Get("X-Sample-Id") == "" {
			t.Errorf("LLM call headers %v", c)
		}
	}
}

// TestNoLabelNoGrading: a row without label or metadata asks for no
// grader callback; the sample is the proxy's record (nil messages) with no
// reward.
func TestNoLabelNoGrading(t *testing.T) {
	p := newPolicy(t)
	h, _ := startHost(t, osmosisserver.Config{Env: secretEnv})
	r, err := run(within(t, 30*time.Second), t, h, p, "nolabel", "What is 6 times 7?", nil)
	if err != nil {
		t.Fatal(err)
	}
	if s := sampleOf(t, r); s.msgs != nil || s.reward != nil || s.finish != "stop" {
		t.Errorf("sample %+v", s)
	}
}

// TestServerFailureIsTheRolloutsError: a rollout the server fails (here:
// its required secret is missing) fails with the server's message, which
// names the variable and not its value.
func TestServerFailureIsTheRolloutsError(t *testing.T) {
	p := newPolicy(t)
	h, _ := startHost(t, osmosisserver.Config{})
	_, err := run(within(t, 30*time.Second), t, h, p, "nosecret", "What is 6 times 7?", ptr("42"))
	if err == nil || !strings.Contains(err.Error(), "agent_error: MULTIPLY_SECRET is not set") || errors.Is(err, osmo.ErrInvalidInput) {
		t.Fatalf("err = %v", err)
	}
}

// TestServerTimeoutIsATimeout: the server's agent_timeout_sec comes from
// the rollout's deadline, and its timeout is the rollout's (ErrTimeout).
func TestServerTimeoutIsATimeout(t *testing.T) {
	p := newPolicy(t)
	env := map[string]string{"MULTIPLY_SECRET": "x", "MULTIPLY_TURN_DELAY_SEC": "10"}
	h, _ := startHost(t, osmosisserver.Config{Env: env})
	begin := time.Now()
	_, err := run(within(t, 4*time.Second), t, h, p, "slow", "What is 6 times 7?", ptr("42"))
	if !errors.Is(err, osmo.ErrTimeout) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
	if took := time.Since(begin); took > 4*time.Second {
		t.Errorf("took %s", took)
	}
}

// TestCancelReachesTheServer: a rollout whose context ends returns at once
// and is cancelled on its server.
func TestCancelReachesTheServer(t *testing.T) {
	p := newPolicy(t)
	env := map[string]string{"MULTIPLY_SECRET": "x", "MULTIPLY_TURN_DELAY_SEC": "1"}
	h, out := startHost(t, osmosisserver.Config{Env: env})
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(300*time.Millisecond, cancel)
	begin := time.Now()
	_, err := run(ctx, t, h, p, "cancel-me", "What is 6 times 7?", ptr("42"))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if took := time.Since(begin); took > time.Second {
		t.Errorf("returned %s after the cancel", took)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(out.String(), "rollout cancel-me: cancelled") && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(out.String(), "rollout cancel-me: cancelled") {
		t.Errorf("the server did not cancel the rollout:\n%s", out.String())
	}
}

// TestCrashEndsHeldRolloutsAndRestarts: every rollout a process held when
// it was SIGKILLed ends once with an error naming the crash; the process is
// restarted and later rollouts succeed.
func TestCrashEndsHeldRolloutsAndRestarts(t *testing.T) {
	p := newPolicy(t)
	env := map[string]string{"MULTIPLY_SECRET": "x", "MULTIPLY_TURN_DELAY_SEC": "2"}
	h, _ := startHost(t, osmosisserver.Config{Env: env})
	victim := h.PIDs()[0]
	const n = 3
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			_, errs[i] = run(within(t, 30*time.Second), t, h, p, fmt.Sprintf("held-%d", i), "What is 6 times 7?", ptr("42"))
		})
	}
	waitHealthRunning(t, h, n)
	if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("rollout server (pid %d) died while running the rollout", victim)) ||
			!strings.Contains(err.Error(), "SIGKILL") {
			t.Errorf("rollout %d: %v", i, err)
		}
	}
	// The next rollout waits for the restart and succeeds.
	r, err := run(within(t, 30*time.Second), t, h, p, "after", "What is 2 times 3?", ptr("6"))
	if err != nil {
		t.Fatal(err)
	}
	if s := sampleOf(t, r); s.reward == nil || *s.reward != 1 || s.extra["server_pid"] == float64(victim) {
		t.Errorf("after the restart: %+v", s)
	}
	if h.Restarts() != 1 || h.PIDs()[0] == victim || h.PIDs()[0] == 0 {
		t.Errorf("restarts %d, pids %v (victim %d)", h.Restarts(), h.PIDs(), victim)
	}
}

// waitHealthRunning waits until the servers report n rollouts running.
func waitHealthRunning(t *testing.T, h *osmosisserver.Host, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		total := 0
		for _, u := range h.URLs() {
			resp, err := http.Get(u + "/health")
			if err != nil {
				continue
			}
			var body struct {
				Concurrency struct{ Running int } `json:"concurrency"`
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			_ = json.Unmarshal(b, &body)
			total += body.Concurrency.Running
		}
		if total >= n {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the servers never ran %d rollouts", n)
}

// TestFirstStartFailureFailsStart: a rollout whose server cannot start
// fails Start with its output, and leaves nothing running.
func TestFirstStartFailureFailsStart(t *testing.T) {
	dir := t.TempDir()
	h, err := osmosisserver.New(osmosisserver.Config{Dir: dir, Entrypoint: "main.py", Procs: 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Start(t.Context()); err == nil || !strings.Contains(err.Error(), "entrypoint") {
		t.Fatalf("Start = %v", err)
	}
}

// TestAtCapacityWaitsRetryAfter: a server at capacity answers 429; the
// rollout waits its Retry-After and is taken later.
func TestAtCapacityWaitsRetryAfter(t *testing.T) {
	p := newPolicy(t)
	env := map[string]string{"MULTIPLY_SECRET": "x", "MULTIPLY_MAX_CONCURRENT": "1", "MULTIPLY_RETRY_AFTER_SEC": "1", "MULTIPLY_TURN_DELAY_SEC": "0.3"}
	var logs logtest.Buffer
	out := &logtest.Buffer{}
	h, err := osmosisserver.New(osmosisserver.Config{Dir: fixture, Env: env, Output: out, Logger: slog.New(slog.NewTextHandler(tWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Stop(context.Background()) })
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Go(func() {
			_, errs[i] = runLogged(within(t, 30*time.Second), &logs, h, p, fmt.Sprintf("cap-%d", i), "What is 6 times 7?", ptr("42"))
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("rollout %d: %v", i, err)
		}
	}
	if !strings.Contains(logs.String(), "at capacity; waiting") || !strings.Contains(logs.String(), "retry_after=1s") {
		t.Errorf("no 429 was waited out:\n%s", logs.String())
	}
}

// TestServerWithoutGrader: a server that posts no grader callback still
// ends its rollout as a success, before the rollout's deadline, with the
// proxy's record as the sample and no reward; one that refuses a rollout
// with 422 fails it as invalid input.
func TestServerWithoutGrader(t *testing.T) {
	p := newPolicy(t)
	h, _ := startHost(t, osmosisserver.Config{Dir: "testdata", Entrypoint: "nograder.py", GraderTimeout: time.Second})
	begin := time.Now()
	r, err := run(within(t, 20*time.Second), t, h, p, "nograder", "What is 6 times 7?", ptr("42"))
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(begin); took < 5*time.Second || took > 10*time.Second {
		t.Errorf("took %s, want the grader's budget and 5 s", took)
	}
	if s := sampleOf(t, r); s.msgs != nil || s.reward != nil || s.finish != "stop" {
		t.Errorf("sample %+v", s)
	}
	// With a deadline sooner than that, the wait ends before it.
	begin = time.Now()
	if _, err := run(within(t, 3*time.Second), t, h, p, "nograder-short", "What is 6 times 7?", ptr("42")); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(begin); took > 3*time.Second {
		t.Errorf("took %s, past the deadline", took)
	}
	_, err = run(within(t, 10*time.Second), t, h, p, "refused", "What is 6 times 7?", ptr("bad"))
	if !errors.Is(err, osmo.ErrInvalidInput) || !strings.Contains(err.Error(), "label is bad") {
		t.Errorf("refused rollout: %v", err)
	}
}

// TestServerExitsMidRollout: a server that exits on its own while running
// a rollout (MULTIPLY_CRASH_AFTER) fails that rollout naming its exit
// status, and the next rollout runs on its replacement.
func TestServerExitsMidRollout(t *testing.T) {
	p := newPolicy(t)
	env := map[string]string{"MULTIPLY_SECRET": "x", "MULTIPLY_CRASH_AFTER": "2"}
	h, _ := startHost(t, osmosisserver.Config{Env: env})
	first := h.PIDs()[0]
	if _, err := run(within(t, 30*time.Second), t, h, p, "before", "What is 6 times 7?", ptr("42")); err != nil {
		t.Fatal(err)
	}
	_, err := run(within(t, 30*time.Second), t, h, p, "crashing", "What is 6 times 7?", ptr("42"))
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("rollout server (pid %d) died while running the rollout: rollout server exited with status 3", first)) {
		t.Fatalf("err = %v", err)
	}
	r, err := run(within(t, 30*time.Second), t, h, p, "after", "What is 6 times 7?", ptr("42"))
	if err != nil {
		t.Fatal(err)
	}
	if s := sampleOf(t, r); s.reward == nil || *s.reward != 1 || s.extra["server_pid"] == float64(first) {
		t.Errorf("after the restart: %+v", s)
	}
}
