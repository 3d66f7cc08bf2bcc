package rollout_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/gen/osmo/rollout/v1/rolloutv1connect"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
	"github.com/osmo-rl/osmo/services/rollout"
)

// pauseEngine is an engine with vLLM's pause endpoints that notes each
// control call.
type pauseEngine struct {
	url  string
	mu   sync.Mutex
	seen []string
}

func newPauseEngine(t *testing.T) *pauseEngine {
	e := &pauseEngine{}
	mux := http.NewServeMux()
	note := func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.seen = append(e.seen, r.Method+" "+r.URL.RequestURI())
		e.mu.Unlock()
	}
	mux.HandleFunc("POST /pause", note)
	mux.HandleFunc("POST /resume", note)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	e.url = srv.URL + "/v1"
	return e
}

func (e *pauseEngine) calls() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.seen...)
}

// restJSON posts (or gets, with body "") path on the gateway.
func restJSON(t *testing.T, base, path, body string) (int, map[string]any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	method, rd := http.MethodGet, io.Reader(nil)
	if body != "" {
		method, rd = http.MethodPost, strings.NewReader(body)
	}
	req, _ := http.NewRequestWithContext(ctx, method, base+path, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%s %s: not JSON: %s", method, path, b)
	}
	return resp.StatusCode, out
}

func TestPolicyPauseResumeRules(t *testing.T) {
	e := newPauseEngine(t)
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.Policy.Engines = llmproxy.EngineList{e.url}
	}})

	waitFor(t, "the replica to acknowledge the policy state", func() bool {
		_, body := restJSON(t, h.rest, "/v1/policy", "")
		r, _ := body["replicas"].([]any)
		return len(r) == 1
	})
	code, body := restJSON(t, h.rest, "/v1/policy/pause", `{"mode":"freeze"}`)
	if code != http.StatusUnprocessableEntity || !strings.Contains(mustMarshal(body), "mode") {
		t.Errorf("unknown mode: %d %v; want 422 naming mode", code, body)
	}
	if code, body := restJSON(t, h.rest, "/v1/policy/resume", `{"version":1}`); code != http.StatusConflict {
		t.Errorf("resume without a pause: %d %v; want 409", code, body)
	}
	if code, body := restJSON(t, h.rest, "/v1/policy/resume", `{"version":-1}`); code != http.StatusUnprocessableEntity {
		t.Errorf("negative version: %d %v; want 422", code, body)
	}
	code, body = restJSON(t, h.rest, "/v1/policy/pause", `{"mode":"keep"}`)
	if code != http.StatusOK || body["paused"] != true || body["mode"] != "keep" {
		t.Fatalf("pause: %d %v", code, body)
	}
	engines, _ := body["engines"].([]any)
	if len(engines) != 1 || engines[0].(map[string]any)["api"] != "vllm" {
		t.Errorf("engines after pause: %v", body["engines"])
	}
	replicas, _ := body["replicas"].([]any)
	if len(replicas) != 1 || replicas[0].(map[string]any)["paused"] != true {
		t.Errorf("replicas after pause: %v", body["replicas"])
	}
	// A second pause, stronger: the pause stays, in abort mode.
	if code, body := restJSON(t, h.rest, "/v1/policy/pause", `{"mode":"abort"}`); code != http.StatusOK || body["mode"] != "abort" {
		t.Errorf("second pause: %d %v", code, body)
	}
	if code, body := restJSON(t, h.rest, "/v1/policy/resume", `{"version":2}`); code != http.StatusOK || body["paused"] == true || body["version"] != float64(2) {
		t.Fatalf("resume: %d %v", code, body)
	}
	if code, body := restJSON(t, h.rest, "/v1/policy/resume", `{"version":2}`); code != http.StatusOK {
		t.Errorf("the same resume repeated: %d %v; want 200", code, body)
	}
	if code, body := restJSON(t, h.rest, "/v1/policy/resume", `{"version":3}`); code != http.StatusConflict {
		t.Errorf("resume to another version without a pause: %d %v; want 409", code, body)
	}
	restJSON(t, h.rest, "/v1/policy/pause", `{"mode":"wait"}`)
	if code, body := restJSON(t, h.rest, "/v1/policy/resume", `{"version":1}`); code != http.StatusConflict {
		t.Errorf("resume to a lower version: %d %v; want 409", code, body)
	}
	if code, body := restJSON(t, h.rest, "/v1/policy", ""); code != http.StatusOK || body["paused"] != true || body["version"] != float64(2) {
		t.Errorf("GET /v1/policy: %d %v", code, body)
	}
	// The same state over Connect and gRPC.
	cst, err := rolloutv1connect.NewRolloutServiceClient(http.DefaultClient, h.rest).GetPolicy(t.Context(), &rolloutv1.GetPolicyRequest{})
	if err != nil || !cst.GetPaused() || cst.GetMode() != "wait" || cst.GetVersion() != 2 {
		t.Errorf("Connect GetPolicy: %v, %v", cst, err)
	}
	if _, err := h.client.PausePolicy(t.Context(), &rolloutv1.PausePolicyRequest{Mode: "later"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("gRPC pause with an unknown mode: %v, want InvalidArgument", err)
	}
	want := []string{"POST /pause?mode=keep", "POST /pause?mode=abort", "POST /resume", "POST /pause?mode=wait"}
	if got := e.calls(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("engine control calls = %q, want %q", got, want)
	}
}

func mustMarshal(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// meteredReplica is replicaOn with a registry of its own.
func meteredReplica(t *testing.T, url, name string, share *harness) (*harness, *prometheus.Registry) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{URLs: []string{url}, Name: name, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	reg := prometheus.NewRegistry()
	h := newHarness(t, harnessOpts{share: share, cfg: func(c *rollout.Config) {
		c.State, c.ReplicaName, c.Metrics = st, name, reg
		c.RolloutTimeout = 20 * time.Second
		c.Policy.Heartbeat = 200 * time.Millisecond
	}})
	return h, reg
}

func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return -1
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPolicyPauseAcrossReplicas: a pause on one replica holds the calls
// of rollouts on the other; a replica started while paused starts paused;
// after the resume the held calls carry the new version.
func TestPolicyPauseAcrossReplicas(t *testing.T) {
	url := sharedNATS(t)
	a, regA := meteredReplica(t, url, "replica-a", nil)
	b, regB := meteredReplica(t, url, "replica-b", a)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	// Both replicas serve (and acknowledge the state) before the pause.
	waitFor(t, "both replicas to acknowledge the policy state", func() bool {
		st, err := a.client.GetPolicy(ctx, &rolloutv1.GetPolicyRequest{})
		return err == nil && len(st.GetReplicas()) == 2
	})
	st, err := a.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "abort"})
	if err != nil {
		t.Fatalf("PausePolicy: %v", err)
	}
	if len(st.GetReplicas()) != 2 {
		t.Errorf("the pause answered with replicas %v, want both", st.GetReplicas())
	}
	for name, reg := range map[string]*prometheus.Registry{"a": regA, "b": regB} {
		if v := gauge(t, reg, "osmo_llmproxy_policy_paused"); v != 1 {
			t.Errorf("replica %s paused gauge = %v once the pause answered, want 1", name, v)
		}
	}

	// Rollouts started now, wherever they run, wait at the gate.
	for _, id := range []string{"held-1", "held-2", "held-3"} {
		b.start(t, b.startReq(t, id))
	}
	waitFor(t, "three held calls", func() bool {
		return gauge(t, regA, "osmo_llmproxy_policy_held_calls")+gauge(t, regB, "osmo_llmproxy_policy_held_calls") == 3
	})

	// A replica that starts now starts paused.
	c, regC := meteredReplica(t, url, "replica-c", a)
	waitFor(t, "replica c to apply the pause", func() bool { return gauge(t, regC, "osmo_llmproxy_policy_paused") == 1 })
	_ = c

	if _, err := b.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: 7}); err != nil {
		t.Fatalf("ResumePolicy: %v", err)
	}
	for _, id := range []string{"held-1", "held-2", "held-3"} {
		r := b.waitDone(t, id)
		if r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
			t.Fatalf("%s: %v %s", id, r.GetState(), r.GetErrorMessage())
		}
		for _, s := range r.GetSamples() {
			for _, call := range s.GetLlmCalls() {
				if call.GetPolicyVersion() != 7 || call.GetHeldMs() <= 0 && call == s.GetLlmCalls()[0] {
					t.Errorf("%s: call version %d held %vms; want 7, the first held", id, call.GetPolicyVersion(), call.GetHeldMs())
				}
			}
		}
	}
	if v := gauge(t, regC, "osmo_llmproxy_policy_version"); v != 7 {
		t.Errorf("replica c version = %v, want 7", v)
	}
}

// TestStaleRollouts: a rollout whose call was answered by version 0 and
// that finishes after a resume to version 2 is two versions behind: with
// --max-staleness 1 it is flagged (record, rows, metrics) or cancelled.
func TestStaleRollouts(t *testing.T) {
	for _, action := range []string{rollout.StaleFlag, rollout.StaleCancel} {
		t.Run(action, func(t *testing.T) {
			called, release := make(chan struct{}, 1), make(chan struct{})
			wf := mustWorkflow(t, "one-call", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
				m, err := chatOnceWith(ctx, wc.Rollout.Endpoint("s"), wc.Prompt, nil, map[string]any{"return_token_ids": true, "logprobs": true})
				if err != nil {
					return err
				}
				called <- struct{}{}
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
				return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
					return osmo.EncodeMessages(append(append([]osmo.Message(nil), wc.Prompt...), m))
				}))
			})
			reg := prometheus.NewRegistry()
			h := newHarness(t, harnessOpts{wf: wf, cfg: func(c *rollout.Config) {
				c.Policy.StaleAction, c.Policy.MaxStaleness, c.Metrics = action, 1, reg
			}})
			h.start(t, h.startReq(t, "stale-1"))
			select {
			case <-called:
			case <-time.After(testTimeout):
				t.Fatal("the workflow made no call")
			}
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			if _, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "keep"}); err != nil {
				t.Fatal(err)
			}
			if _, err := h.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: 2}); err != nil {
				t.Fatal(err)
			}
			close(release)
			r := h.waitDone(t, "stale-1")
			if pv := r.GetPolicyVersions(); pv == nil || pv.GetMin() != 0 || pv.GetMax() != 0 {
				t.Errorf("policy_versions = %v, want 0..0", pv)
			}
			if n := counterValue(t, reg, "osmo_rollouts_stale_total", action); n != 1 {
				t.Errorf("osmo_rollouts_stale_total{action=%q} = %v, want 1", action, n)
			}
			if action == rollout.StaleCancel {
				if r.GetState() != rolloutv1.State_STATE_CANCELLED || r.GetErrorCategory() != "stale_policy" {
					t.Fatalf("cancelled stale rollout: %v %q %q", r.GetState(), r.GetErrorCategory(), r.GetErrorMessage())
				}
				return
			}
			if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || !r.GetStale() {
				t.Fatalf("flagged stale rollout: %v stale=%v %s", r.GetState(), r.GetStale(), r.GetErrorMessage())
			}
			rows := rowsOf(t, h.client, "stale-1")
			if len(rows) == 0 {
				t.Fatal("no rows")
			}
			for _, row := range rows {
				if !row.GetStale() || len(row.GetVersions()) != 1 || row.GetVersions()[0].GetVersion() != 0 {
					t.Errorf("row: stale %v versions %v", row.GetStale(), row.GetVersions())
				}
			}
		})
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetValue() == label {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// TestPauseStopsTheRolloutClock: a rollout held by a pause for longer than
// its whole budget still succeeds: the time held is not the agent's.
func TestPauseStopsTheRolloutClock(t *testing.T) {
	// The budget covers the rollout's own time (queueing, the call after
	// the resume, grading) on a loaded machine; the hold is twice it.
	const budget = 1500 * time.Millisecond
	wf := mustWorkflow(t, "one-call", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		m, err := chatOnce(ctx, wc.Rollout.Endpoint("s"), wc.Prompt, nil)
		if err != nil {
			return err
		}
		return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return osmo.EncodeMessages(append(append([]osmo.Message(nil), wc.Prompt...), m))
		}))
	})
	reg := prometheus.NewRegistry()
	h := newHarness(t, harnessOpts{wf: wf, cfg: func(c *rollout.Config) { c.RolloutTimeout, c.Metrics = budget, reg }})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "abort"}); err != nil {
		t.Fatal(err)
	}
	h.start(t, h.startReq(t, "clock-1"))
	waitFor(t, "the call to be held", func() bool { return gauge(t, reg, "osmo_llmproxy_policy_held_calls") == 1 })
	// Wall time passes beyond the budget while the call is held.
	time.Sleep(2 * budget)
	if _, err := h.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: 1}); err != nil {
		t.Fatal(err)
	}
	r := h.waitDone(t, "clock-1")
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
		t.Fatalf("held rollout: %v %s %s", r.GetState(), r.GetErrorCategory(), r.GetErrorMessage())
	}
	calls := r.GetSamples()[0].GetLlmCalls()
	if len(calls) != 1 || calls[0].GetHeldMs() < float64(2*budget/time.Millisecond) || calls[0].GetPolicyVersion() != 1 {
		t.Errorf("call: %d calls, held %vms, version %d", len(calls), calls[0].GetHeldMs(), calls[0].GetPolicyVersion())
	}
}

// TestAbortPauseOvertakesAWaitPause: while a wait pause waits for a call
// in flight, an abort pause cuts the call and both answer; after the
// resume the call is sent again and the agent gets one answer.
func TestAbortPauseOvertakesAWaitPause(t *testing.T) {
	mock, err := mockllm.New(mockllm.Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	arrived, stop := make(chan struct{}, 1), make(chan struct{})
	var first sync.Once
	policy := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		blocked := false
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			first.Do(func() { blocked = true })
		}
		if blocked {
			arrived <- struct{}{}
			// Held until cut (the trainer relays the call, and may not
			// pass the cut on) or the test ends.
			select {
			case <-r.Context().Done():
			case <-stop:
			}
			return
		}
		mock.ServeHTTP(w, r)
	})
	wf := mustWorkflow(t, "one-call", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		m, err := chatOnce(ctx, wc.Rollout.Endpoint("s"), wc.Prompt, nil)
		if err != nil {
			return err
		}
		return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return osmo.EncodeMessages(append(append([]osmo.Message(nil), wc.Prompt...), m))
		}))
	})
	reg := prometheus.NewRegistry()
	h := newHarness(t, harnessOpts{wf: wf, policy: policy, cfg: func(c *rollout.Config) {
		c.Metrics, c.RolloutTimeout = reg, 30*time.Second
		// Far beyond the test's waits: only applying the abort at once passes.
		c.Policy.AckTimeout = time.Minute
	}})
	t.Cleanup(func() { close(stop) })
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	waitFor(t, "the replica to acknowledge the policy state", func() bool {
		st, err := h.client.GetPolicy(ctx, &rolloutv1.GetPolicyRequest{})
		return err == nil && len(st.GetReplicas()) == 1
	})
	h.start(t, h.startReq(t, "overtaken-1"))
	select {
	case <-arrived:
	case <-ctx.Done():
		t.Fatal("the call never reached the policy")
	}
	waited := make(chan error, 1)
	go func() {
		_, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "wait"})
		waited <- err
	}()
	waitFor(t, "the wait pause to close the gate", func() bool { return gauge(t, reg, "osmo_llmproxy_policy_paused") == 1 })
	st, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "abort"})
	if err != nil || st.GetMode() != "abort" {
		t.Fatalf("abort pause during a wait pause: %v, %v", st, err)
	}
	if err := <-waited; err != nil {
		t.Fatalf("the wait pause: %v", err)
	}
	if _, err := h.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: 1}); err != nil {
		t.Fatal(err)
	}
	r := h.waitDone(t, "overtaken-1")
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
		t.Fatalf("rollout: %v %s", r.GetState(), r.GetErrorMessage())
	}
	c := r.GetSamples()[0].GetLlmCalls()[0]
	if a := c.GetUpstreamAttempts(); len(a) != 1 || !a[0].GetPaused() || c.GetPolicyVersion() != 1 || a[0].GetPolicyVersion() != 0 {
		t.Errorf("call: upstream attempts %v, version %d", a, c.GetPolicyVersion())
	}
}
