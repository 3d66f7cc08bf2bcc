package llmproxy_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// engine is an engine double: chat completions that block until released
// (or cut), and optionally vLLM's or SGLang's pause endpoints.
type engine struct {
	base    string
	arrived chan struct{} // one send per chat request
	release chan struct{} // closed to let blocked requests answer

	mu      sync.Mutex
	control []string // "POST /pause?mode=keep", ...
	block   bool     // chat requests wait for release
}

func newEngine(t *testing.T, api string, block bool) *engine {
	t.Helper()
	e := &engine{arrived: make(chan struct{}, 16), release: make(chan struct{}), block: block}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		e.mu.Lock()
		block := e.block
		e.mu.Unlock()
		e.arrived <- struct{}{}
		if block {
			select {
			case <-e.release:
			case <-r.Context().Done():
				return
			}
		}
		okJSON(w, r)
	})
	note := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		e.mu.Lock()
		e.control = append(e.control, strings.TrimSpace(r.Method+" "+r.URL.RequestURI()+" "+string(b)))
		e.mu.Unlock()
	}
	switch api {
	case llmproxy.EngineAPIVLLM:
		mux.HandleFunc("POST /pause", note)
		mux.HandleFunc("POST /resume", note)
	case llmproxy.EngineAPISGLang:
		mux.HandleFunc("POST /pause_generation", note)
		mux.HandleFunc("POST /continue_generation", note)
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	e.base = srv.URL + "/v1"
	return e
}

func (e *engine) controls() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.control...)
}

func (e *engine) unblock() {
	e.mu.Lock()
	e.block = false
	e.mu.Unlock()
}

func (e *engine) waitArrival(t *testing.T) {
	t.Helper()
	select {
	case <-e.arrived:
	case <-time.After(testTimeout):
		t.Fatal("the engine got no request")
	}
}

// gated is a proxy to e behind a gate.
func gated(t *testing.T, e *engine, engines llmproxy.EngineSet) (*harness, *llmproxy.Gate, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	g, err := llmproxy.NewGate(llmproxy.GateConfig{Engines: engines, Metrics: reg})
	if err != nil {
		t.Fatal(err)
	}
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: e.base}),
		Gate:   g, Timeout: testTimeout, Metrics: reg,
	})
	return h, g, reg
}

type answer struct {
	resp *http.Response
	body []byte
}

func postAsync(t *testing.T, url, body string) <-chan answer {
	out := make(chan answer, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
		req.Header.Set(llmproxy.HeaderRolloutID, "r1")
		req.Header.Set(llmproxy.HeaderSampleID, "s1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Errorf("POST: %v", err)
			out <- answer{}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		out <- answer{resp, b}
	}()
	return out
}

// eventually polls cond; a gate's state is read, never waited on by time.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func background(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

func TestGateAbortResendsAfterResume(t *testing.T) {
	e := newEngine(t, "", true)
	h, g, reg := gated(t, e, llmproxy.EngineList{e.base})
	ctx := background(t)

	got := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	e.waitArrival(t)
	e.unblock() // the resent attempt answers at once
	if err := g.Pause(ctx, llmproxy.PauseAbort); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	// Pause answered once the attempt was cut: nothing is upstream, the
	// call waits at the gate and the agent has no answer yet.
	eventually(t, "the cut call to wait at the gate", func() bool { return g.State().Held == 1 })
	if s := g.State(); s.InFlight != 0 || !s.Paused || s.Mode != llmproxy.PauseAbort {
		t.Fatalf("state after abort pause = %+v", s)
	}
	select {
	case a := <-got:
		t.Fatalf("the agent got an answer while paused: %d %s", a.resp.StatusCode, a.body)
	default:
	}
	if s := g.State(); len(s.Engines) != 1 || s.Engines[0].API != llmproxy.EngineAPINone || !s.Engines[0].Paused {
		t.Errorf("engine without pause endpoints: %+v", s.Engines)
	}
	if err := g.Resume(ctx, 3); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	a := <-got
	if a.resp == nil || a.resp.StatusCode != http.StatusOK {
		t.Fatalf("answer after resume: %+v", a)
	}
	c := h.next(t)
	if c.PolicyVersion != 3 || c.Attempts != 2 || c.StatusCode != 200 {
		t.Errorf("call: version %d, attempts %d, status %d; want 3, 2, 200", c.PolicyVersion, c.Attempts, c.StatusCode)
	}
	if len(c.UpstreamAttempts) != 1 || c.UpstreamAttempts[0].Attempt != 1 || !c.UpstreamAttempts[0].Paused || c.UpstreamAttempts[0].PolicyVersion != 0 {
		t.Errorf("upstream attempts = %+v, want the first, paused at version 0", c.UpstreamAttempts)
	}
	if c.HeldMS <= 0 {
		t.Errorf("held_ms = %v, want > 0", c.HeldMS)
	}
	if v := versionCount(t, reg, "3"); v != 1 {
		t.Errorf("calls of version 3 = %v, want 1", v)
	}
}

// versionCount reads osmo_llmproxy_calls_by_policy_version_total{version}.
func versionCount(t *testing.T, reg *prometheus.Registry, version string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "osmo_llmproxy_calls_by_policy_version_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if l := m.GetLabel(); len(l) == 1 && l[0].GetValue() == version {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func TestGateWaitAnswersOnceCallsFinished(t *testing.T) {
	e := newEngine(t, llmproxy.EngineAPIVLLM, true)
	h, g, _ := gated(t, e, llmproxy.EngineList{e.base})
	ctx := background(t)

	first := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	e.waitArrival(t)
	paused := make(chan error, 1)
	go func() { paused <- g.Pause(ctx, llmproxy.PauseWait) }()
	eventually(t, "the pause to close the gate", func() bool { return g.State().Paused })
	second := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	eventually(t, "the new call to wait at the gate", func() bool { return g.State().Held == 1 })
	select {
	case err := <-paused:
		t.Fatalf("wait pause answered (%v) with a call in flight", err)
	default:
	}
	close(e.release)
	if a := <-first; a.resp == nil || a.resp.StatusCode != 200 {
		t.Fatalf("the call in flight: %+v", a)
	}
	if err := <-paused; err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if got := e.controls(); len(got) != 1 || got[0] != "POST /pause?mode=wait" {
		t.Errorf("engine control calls = %q", got)
	}
	if c := h.next(t); c.PolicyVersion != 0 {
		t.Errorf("first call version %d, want 0", c.PolicyVersion)
	}
	if err := g.Resume(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if a := <-second; a.resp == nil || a.resp.StatusCode != 200 {
		t.Fatalf("the held call: %+v", a)
	}
	if c := h.next(t); c.PolicyVersion != 1 || len(c.UpstreamAttempts) != 0 {
		t.Errorf("held call: version %d, paused attempts %v; want 1, none", c.PolicyVersion, c.UpstreamAttempts)
	}
	if got := e.controls(); len(got) != 2 || got[1] != "POST /resume" {
		t.Errorf("engine control calls = %q", got)
	}
}

func TestGateKeepLeavesCallsToTheEngine(t *testing.T) {
	e := newEngine(t, llmproxy.EngineAPISGLang, true)
	h, g, _ := gated(t, e, llmproxy.EngineList{e.base})
	ctx := background(t)

	first := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	e.waitArrival(t)
	if err := g.Pause(ctx, llmproxy.PauseKeep); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if s := g.State(); s.InFlight != 1 || s.Engines[0].API != llmproxy.EngineAPISGLang {
		t.Fatalf("keep pause: %+v", s)
	}
	if err := g.Resume(ctx, 2); err != nil {
		t.Fatal(err)
	}
	close(e.release)
	if a := <-first; a.resp == nil || a.resp.StatusCode != 200 {
		t.Fatalf("kept call: %+v", a)
	}
	// The kept call finished under the new weights.
	if c := h.next(t); c.PolicyVersion != 2 || c.Attempts != 1 {
		t.Errorf("kept call: version %d attempts %d; want 2, 1", c.PolicyVersion, c.Attempts)
	}
	want := []string{`POST /pause_generation {"mode":"in_place"}`, "POST /continue_generation {}"}
	if got := e.controls(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("engine control calls = %q, want %q", got, want)
	}
}

func TestGateOverlappingPausesTakeTheStrongerMode(t *testing.T) {
	e := newEngine(t, "", true)
	h, g, _ := gated(t, e, nil)
	ctx := background(t)

	got := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	e.waitArrival(t)
	if err := g.Pause(ctx, llmproxy.PauseKeep); err != nil {
		t.Fatal(err)
	}
	e.unblock()
	if err := g.Pause(ctx, llmproxy.PauseAbort); err != nil {
		t.Fatal(err)
	}
	if s := g.State(); s.Mode != llmproxy.PauseAbort || s.InFlight != 0 {
		t.Fatalf("after keep then abort: %+v", s)
	}
	// A weaker pause on top leaves the mode.
	if err := g.Pause(ctx, llmproxy.PauseWait); err != nil {
		t.Fatal(err)
	}
	if s := g.State(); s.Mode != llmproxy.PauseAbort {
		t.Fatalf("after a wait pause on an abort: mode %q", s.Mode)
	}
	if err := g.Resume(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if a := <-got; a.resp == nil || a.resp.StatusCode != 200 {
		t.Fatalf("answer: %+v", a)
	}
	if c := h.next(t); len(c.UpstreamAttempts) != 1 || c.PolicyVersion != 1 {
		t.Errorf("call: %+v", c)
	}
}

func TestGateResumeRules(t *testing.T) {
	g, err := llmproxy.NewGate(llmproxy.GateConfig{Version: 2})
	if err != nil {
		t.Fatal(err)
	}
	ctx := background(t)
	if err := g.Resume(ctx, 3); !errors.Is(err, llmproxy.ErrNotPaused) {
		t.Errorf("resume without a pause: %v, want ErrNotPaused", err)
	}
	if err := g.Resume(ctx, 2); err != nil {
		t.Errorf("resume to the version in force, not paused: %v, want nil", err)
	}
	if err := g.Pause(ctx, llmproxy.PauseMode("freeze")); err == nil || !strings.HasPrefix(err.Error(), "mode:") {
		t.Errorf("unknown mode: %v, want an error naming mode", err)
	}
	if err := g.Pause(ctx, llmproxy.PauseKeep); err != nil {
		t.Fatal(err)
	}
	if err := g.Resume(ctx, 1); !errors.Is(err, llmproxy.ErrVersionBehind) {
		t.Errorf("resume to a lower version: %v, want ErrVersionBehind", err)
	}
	if !g.State().Paused {
		t.Error("a refused resume opened the gate")
	}
	if err := g.Resume(ctx, 4); err != nil {
		t.Fatal(err)
	}
	if err := g.Resume(ctx, 4); err != nil {
		t.Errorf("the same resume repeated: %v, want nil", err)
	}
	if v := g.Version(); v != 4 {
		t.Errorf("version %d, want 4", v)
	}
	if _, err := llmproxy.NewGate(llmproxy.GateConfig{Version: -1}); err == nil {
		t.Error("a negative version was accepted")
	}
}

func TestGateEngineFailureNamesTheEngine(t *testing.T) {
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "busy", http.StatusServiceUnavailable)
	}))
	t.Cleanup(bad.Close)
	g, err := llmproxy.NewGate(llmproxy.GateConfig{Engines: llmproxy.EngineList{bad.URL + "/v1"}})
	if err != nil {
		t.Fatal(err)
	}
	err = g.Pause(background(t), llmproxy.PauseKeep)
	ee, ok := errors.AsType[*llmproxy.EngineError](err)
	if !ok || ee.Engines[bad.URL+"/v1"] == "" {
		t.Fatalf("pause with a failing engine: %v", err)
	}
}

func TestGateAbortCutsAStartedStreamWithATypedError(t *testing.T) {
	sent := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"par"},"finish_reason":null}]}`+"\n\n")
		w.(http.Flusher).Flush()
		close(sent)
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	g, _ := llmproxy.NewGate(llmproxy.GateConfig{})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: srv.URL + "/v1"}), Gate: g, Timeout: testTimeout})

	ctx := background(t)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.url+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set(llmproxy.HeaderRolloutID, "r1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.Contains(line, `"par"`) {
		t.Fatalf("first event: %q %v", line, err)
	}
	<-sent
	if err := g.Pause(ctx, llmproxy.PauseAbort); err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `"code":"policy_paused"`) {
		t.Errorf("stream end = %q, want an error event with code policy_paused", rest)
	}
	c := h.next(t)
	if c.Error == "" || len(c.UpstreamAttempts) != 0 || c.Attempts != 1 {
		t.Errorf("cut stream: error %q, paused attempts %v, attempts %d", c.Error, c.UpstreamAttempts, c.Attempts)
	}
}

func TestGateCallEndsWhileHeld(t *testing.T) {
	e := newEngine(t, "", false)
	g, _ := llmproxy.NewGate(llmproxy.GateConfig{})
	rctx, cancel := context.WithCancelCause(context.Background())
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: e.base, Context: rctx}), Gate: g, Timeout: testTimeout})
	if err := g.Pause(background(t), llmproxy.PauseAbort); err != nil {
		t.Fatal(err)
	}
	got := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	eventually(t, "the call to wait at the gate", func() bool { return g.State().Held == 1 })
	cancel(errors.New("rollout cancelled"))
	a := <-got
	if a.resp == nil || a.resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(a.body), "rollout_ended") {
		t.Fatalf("held call of an ended rollout: %+v %s", a.resp, a.body)
	}
	if c := h.next(t); c.Attempts != 1 || c.PolicyVersion != 0 {
		t.Errorf("call: attempts %d version %d", c.Attempts, c.PolicyVersion)
	}
	if g.State().Held != 0 {
		t.Error("the ended call still counts as held")
	}
}

// TestGateResumeOpensPastAFailingEngine: an engine that cannot take the
// resume (dead, or answering 5xx) is named in the error, but the gate
// opens: one engine must not hold every call of every other engine.
func TestGateResumeOpensPastAFailingEngine(t *testing.T) {
	e := newEngine(t, llmproxy.EngineAPIVLLM, false)
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "busy", http.StatusServiceUnavailable)
	}))
	t.Cleanup(bad.Close)
	h, g, _ := gated(t, e, llmproxy.EngineList{e.base, bad.URL + "/v1"})
	ctx := background(t)
	for _, resume := range []func(int64) error{
		func(v int64) error { return g.Resume(ctx, v) },
		func(v int64) error { return g.Open(ctx, v) },
	} {
		if err := g.Pause(ctx, llmproxy.PauseKeep); err == nil {
			t.Fatal("pause with a failing engine: no error")
		}
		got := postAsync(t, h.url+"/v1/chat/completions", chatBody)
		eventually(t, "the call to wait at the gate", func() bool { return g.State().Held == 1 })
		v := g.Version() + 1
		err := resume(v)
		if ee, ok := errors.AsType[*llmproxy.EngineError](err); !ok || ee.Engines[bad.URL+"/v1"] == "" {
			t.Errorf("resume with a failing engine: %v, want an EngineError naming it", err)
		}
		if s := g.State(); s.Paused || s.Version != v {
			t.Fatalf("after the resume: paused %v version %d, want open at %d", s.Paused, s.Version, v)
		}
		if a := <-got; a.resp == nil || a.resp.StatusCode != http.StatusOK {
			t.Fatalf("the held call: %+v", a)
		}
		if c := h.next(t); c.PolicyVersion != v {
			t.Errorf("held call version %d, want %d", c.PolicyVersion, v)
		}
	}
}

// TestGateResumeOfAGoneEngine: an engine that took the pause and is gone
// by the resume (nothing listens there: it died, or restarts unpaused) has
// nothing left to resume, and the resume succeeds.
func TestGateResumeOfAGoneEngine(t *testing.T) {
	gone := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	g, err := llmproxy.NewGate(llmproxy.GateConfig{Engines: llmproxy.EngineList{gone.URL + "/v1"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := background(t)
	if err := g.Pause(ctx, llmproxy.PauseKeep); err != nil {
		t.Fatal(err)
	}
	gone.Close()
	if err := g.Resume(ctx, 1); err != nil {
		t.Errorf("resume of an engine that is gone: %v, want nil", err)
	}
	if s := g.State(); s.Paused || len(s.Engines) != 1 || s.Engines[0].Paused || s.Engines[0].Error != "" {
		t.Errorf("state after the resume: %+v", s)
	}
}

// A call refused for the token members it asked for, whose second try an
// abort pause cuts, is made a third time after the resume, without the
// members: one call to the agent, three attempts, none of them a retry.
func TestGateAbortAfterTokensRefused(t *testing.T) {
	var (
		mu     sync.Mutex
		bodies []string
	)
	arrived := make(chan struct{}, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		n := len(bodies)
		mu.Unlock()
		arrived <- struct{}{}
		switch {
		case strings.Contains(string(b), "return_token_ids"):
			http.Error(w, `{"error":{"message":"Unrecognized request argument supplied: return_token_ids"}}`, http.StatusBadRequest)
		case n == 2:
			<-r.Context().Done() // cut by the pause
		default:
			okJSON(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	g, err := llmproxy.NewGate(llmproxy.GateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	h := newProxy(t, llmproxy.Config{
		Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: srv.URL + "/v1"}),
		Gate:      g,
		Timeout:   testTimeout,
		AskTokens: true,
		// No retries: a cut or refused attempt must not need one.
		Retry: llmproxy.RetryPolicy{MaxRetries: 0},
	})
	ctx := background(t)
	got := postAsync(t, h.url+"/v1/chat/completions", chatBody)
	for range 2 {
		select {
		case <-arrived:
		case <-ctx.Done():
			t.Fatal("the upstream got fewer than two attempts")
		}
	}
	if err := g.Pause(ctx, llmproxy.PauseAbort); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if err := g.Resume(ctx, 1); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	a := <-got
	if a.resp == nil || a.resp.StatusCode != http.StatusOK {
		t.Fatalf("answer after resume: %+v", a)
	}
	c := h.next(t)
	if c.Attempts != 3 || c.StatusCode != 200 || c.PolicyVersion != 1 {
		t.Errorf("call: attempts %d, status %d, version %d; want 3, 200, 1", c.Attempts, c.StatusCode, c.PolicyVersion)
	}
	if len(c.UpstreamAttempts) != 1 || c.UpstreamAttempts[0].Attempt != 2 || !c.UpstreamAttempts[0].Paused {
		t.Errorf("upstream attempts = %+v, want the second, paused", c.UpstreamAttempts)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bodies) != 3 || strings.Contains(bodies[1], "return_token_ids") || strings.Contains(bodies[2], "return_token_ids") {
		t.Errorf("bodies upstream = %q, want three, the last two without the token members", bodies)
	}
}

// A call held by a pause whose engine leaves the ring meanwhile (say, it
// is restarted for new weights) goes to another engine after the resume
// instead of failing: it never reached the engine that left.
func TestHeldCallMovesWhenItsEngineLeaves(t *testing.T) {
	var (
		down  [2]atomic.Bool
		bases []string
	)
	for i := range down {
		mux := http.NewServeMux()
		mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
			if down[i].Load() {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		})
		mux.HandleFunc("POST /v1/chat/completions", okJSON)
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		bases = append(bases, srv.URL+"/v1")
	}
	set := runEngines(t, llmproxy.EnginesConfig{URLs: bases, ProbeInterval: 50 * time.Millisecond, ProbeTimeout: time.Second})
	g, err := llmproxy.NewGate(llmproxy.GateConfig{Engines: set})
	if err != nil {
		t.Fatal(err)
	}
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{}), Engines: set, Gate: g, Timeout: testTimeout,
		Retry: llmproxy.RetryPolicy{MaxRetries: 2, BaseDelay: time.Minute},
	})
	ctx := background(t)
	url := h.url + "/v1/chat/completions"
	if a := <-postAsync(t, url, chatBody); a.resp == nil || a.resp.StatusCode != http.StatusOK {
		t.Fatalf("first call: %+v", a)
	}
	home := h.next(t).Engine
	if err := g.Pause(ctx, llmproxy.PauseKeep); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	got := postAsync(t, url, chatBody)
	eventually(t, "the call to be held", func() bool { return g.State().Held == 1 })
	down[slices.Index(bases, home)].Store(true)
	eventually(t, "the sample's engine to leave the ring", func() bool { return !set.Up(home) })
	if err := g.Resume(ctx, 1); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	a := <-got
	if a.resp == nil || a.resp.StatusCode != http.StatusOK {
		t.Fatalf("held call after the resume: %+v", a)
	}
	c := h.next(t)
	if c.Engine == home || c.PolicyVersion != 1 || len(c.UpstreamAttempts) != 2 ||
		c.UpstreamAttempts[0].Engine != home || !strings.Contains(c.UpstreamAttempts[0].Error, "left the ring") {
		t.Errorf("call: engine %q (home %q), version %d, attempts %+v", c.Engine, home, c.PolicyVersion, c.UpstreamAttempts)
	}
}
