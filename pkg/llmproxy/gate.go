package llmproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// PauseMode says what a pause does to the calls already under way. Every
// mode holds new calls until the resume.
type PauseMode string

const (
	// PauseKeep leaves calls in flight where they are: engines with a pause
	// endpoint freeze them and finish them after the resume; on an engine
	// without one they run on.
	PauseKeep PauseMode = "keep"
	// PauseWait answers the pause once the calls in flight have finished.
	PauseWait PauseMode = "wait"
	// PauseAbort cuts the upstream attempts in flight; the proxy sends them
	// again after the resume, so the agent sees one answer. A stream that
	// has already sent bytes to the agent ends with an error instead.
	PauseAbort PauseMode = "abort"
)

// ParsePauseMode reads a mode by name.
func ParsePauseMode(s string) (PauseMode, error) {
	switch m := PauseMode(s); m {
	case PauseKeep, PauseWait, PauseAbort:
		return m, nil
	}
	return "", fmt.Errorf("mode: unknown pause mode %q; use keep, wait or abort", s)
}

// Strength orders modes for pauses that overlap: the stronger one wins
// (abort over wait over keep).
func (m PauseMode) Strength() int {
	switch m {
	case PauseAbort:
		return 2
	case PauseWait:
		return 1
	}
	return 0
}

// EngineSet lists the policy engines a pause is forwarded to, by their
// OpenAI base URL (http://vllm:8000/v1); the control endpoints are looked up
// at the URL's root.
type EngineSet interface {
	URLs() []string
}

// EngineList is a fixed EngineSet.
type EngineList []string

// URLs implements EngineSet.
func (l EngineList) URLs() []string { return l }

// Errors of Gate.Resume. (The rollout service checks the same rules on its
// shared switch, answering 409, and applies the switch with Gate.Open.)
var (
	ErrNotPaused     = errors.New("the policy is not paused")
	ErrVersionBehind = errors.New("version is below the current policy version")
)

// errPauseAbort is the cancel cause of an attempt an abort pause cut.
var errPauseAbort = errors.New("policy paused (abort) for a weight update")

// EngineError names the engines that failed a pause or resume.
type EngineError struct {
	Op      string            // "pause" or "resume"
	Engines map[string]string // base URL → what went wrong
}

func (e *EngineError) Error() string {
	names := make([]string, 0, len(e.Engines))
	for n := range e.Engines {
		names = append(names, n)
	}
	slices.Sort(names)
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = n + ": " + e.Engines[n]
	}
	return fmt.Sprintf("llmproxy: %s failed on engine(s) %s", e.Op, strings.Join(parts, "; "))
}

// Engine control kinds found by probing, reported in EngineState.API.
const (
	EngineAPIVLLM   = "vllm"   // POST /pause?mode=, POST /resume
	EngineAPISGLang = "sglang" // POST /pause_generation {"mode"}, POST /continue_generation
	EngineAPINone   = "none"   // no pause endpoint: the gate holds and cuts calls itself
)

// EngineState is one engine as the last pause or resume left it.
type EngineState struct {
	BaseURL string `json:"base_url"`
	API     string `json:"api"` // EngineAPI*, empty before the first pause
	Paused  bool   `json:"paused"`
	Error   string `json:"error,omitempty"`
}

// GateState is a snapshot of a Gate.
type GateState struct {
	Paused   bool          `json:"paused"`
	Mode     PauseMode     `json:"mode,omitempty"`
	Version  int64         `json:"version"`
	InFlight int           `json:"in_flight"` // attempts upstream
	Held     int           `json:"held"`      // calls waiting for the resume
	Engines  []EngineState `json:"engines"`
}

// GateConfig configures a Gate.
type GateConfig struct {
	// Engines receive pauses and resumes; nil forwards to none.
	Engines EngineSet
	// Client carries the engines' control calls; nil means a client with
	// ControlTimeout.
	Client *http.Client
	// ControlTimeout bounds one control call to an engine (default 30s):
	// a pause with mode=wait on vLLM answers once its requests finished.
	ControlTimeout time.Duration
	// Version is the policy version in force at start.
	Version int64
	// Metrics receives the gate's collectors (osmo_llmproxy_policy_*).
	Metrics prometheus.Registerer
}

// Gate is the proxy's pause switch for weight updates. Calls pass it before
// every upstream attempt; while it is paused they wait there. It also
// carries the policy version stamped on every call. Safe for concurrent
// use.
type Gate struct {
	engines EngineSet
	client  *http.Client
	metrics *gateMetrics

	mu        sync.Mutex
	paused    bool
	mode      PauseMode
	version   int64
	since     time.Time     // when the current pause began
	pausedFor time.Duration // the finished pauses' time, summed
	resumed   chan struct{} // closed when not paused
	inflight  map[*gateTicket]struct{}
	held      int             // calls waiting in enter
	drained   []chan struct{} // closed when inflight empties
	states    map[string]EngineState
}

// gateTicket is one upstream attempt that passed the gate.
type gateTicket struct {
	version int64
	cancel  context.CancelCauseFunc
}

// NewGate returns an open gate.
func NewGate(cfg GateConfig) (*Gate, error) {
	if cfg.Version < 0 {
		return nil, fmt.Errorf("llmproxy.NewGate: GateConfig.Version must not be negative, got %d", cfg.Version)
	}
	if cfg.ControlTimeout < 0 {
		return nil, fmt.Errorf("llmproxy.NewGate: GateConfig.ControlTimeout must not be negative, got %s", cfg.ControlTimeout)
	}
	if cfg.ControlTimeout == 0 {
		cfg.ControlTimeout = 30 * time.Second
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: cfg.ControlTimeout}
	}
	open := make(chan struct{})
	close(open)
	g := &Gate{
		engines:  cfg.Engines,
		client:   cfg.Client,
		metrics:  newGateMetrics(cfg.Metrics),
		version:  cfg.Version,
		resumed:  open,
		inflight: map[*gateTicket]struct{}{},
		states:   map[string]EngineState{},
	}
	g.metrics.setVersion(cfg.Version)
	return g, nil
}

// PausedTotal is the time the gate has been paused since it was made, the
// current pause included: what a clock that stops while the policy is
// paused subtracts.
func (g *Gate) PausedTotal() time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused {
		return g.pausedFor + time.Since(g.since)
	}
	return g.pausedFor
}

// Version is the policy version in force.
func (g *Gate) Version() int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.version
}

// State is a snapshot of the gate and its engines.
func (g *Gate) State() GateState {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := GateState{Paused: g.paused, Version: g.version, InFlight: len(g.inflight), Held: g.held}
	if g.paused {
		s.Mode = g.mode
	}
	for _, e := range g.engineList() {
		st, ok := g.states[e]
		if !ok {
			st = EngineState{BaseURL: e}
		}
		s.Engines = append(s.Engines, st)
	}
	return s
}

func (g *Gate) engineList() []string {
	if g.engines == nil {
		return nil
	}
	return g.engines.URLs()
}

// Pause closes the gate: new attempts wait until Resume. It answers once
// the mode is applied: with PauseWait once the attempts in flight have
// finished, with PauseAbort once they have been cut, and once every engine
// has taken the pause. A pause while paused keeps the pause, with the
// stronger of the two modes (abort over wait over keep), and answers once
// that is applied. ctx bounds the wait.
func (g *Gate) Pause(ctx context.Context, mode PauseMode) error {
	if _, err := ParsePauseMode(string(mode)); err != nil {
		return err
	}
	g.mu.Lock()
	if !g.paused {
		g.paused = true
		g.mode = mode
		g.since = time.Now()
		g.resumed = make(chan struct{})
		g.metrics.setPaused(true)
	} else if mode.Strength() > g.mode.Strength() {
		g.mode = mode
	}
	effective := g.mode
	if effective == PauseAbort {
		for t := range g.inflight {
			t.cancel(errPauseAbort)
		}
	}
	var drained chan struct{}
	if effective != PauseKeep && len(g.inflight) > 0 {
		drained = make(chan struct{})
		g.drained = append(g.drained, drained)
	}
	g.mu.Unlock()

	if drained != nil {
		select {
		case <-drained:
		case <-ctx.Done():
			return fmt.Errorf("llmproxy: pause (%s) waiting for calls in flight: %w", effective, context.Cause(ctx))
		}
	}
	return g.control(ctx, "pause", effective)
}

// Resume opens the gate at version, once every engine was asked to resume.
// Resuming to the version in force when not paused is a no-op (a repeated
// resume); otherwise it is ErrNotPaused. A version below the current one is
// ErrVersionBehind. An engine that fails its resume is named in an
// *EngineError, and the gate opens all the same (see Open).
func (g *Gate) Resume(ctx context.Context, version int64) error {
	g.mu.Lock()
	switch {
	case version < g.version:
		cur := g.version
		g.mu.Unlock()
		return fmt.Errorf("version: %w: %d < %d", ErrVersionBehind, version, cur)
	case !g.paused && version == g.version:
		g.mu.Unlock()
		return nil
	case !g.paused:
		g.mu.Unlock()
		return fmt.Errorf("version: %w", ErrNotPaused)
	}
	g.mu.Unlock()
	err := g.control(ctx, "resume", "")
	g.open(version)
	return err
}

// Open brings the gate to the open state at version whatever its state:
// a replica following a shared switch applies it with Open, the switch
// having checked the rules of Resume already. The gate opens even when an
// engine fails its resume (the *EngineError names it): an engine that is
// down or refuses must not hold the calls of every other engine, nor keep
// the rollouts' clocks stopped, until it comes back.
func (g *Gate) Open(ctx context.Context, version int64) error {
	g.mu.Lock()
	paused := g.paused
	if !paused {
		g.version = version
		g.metrics.setVersion(version)
	}
	g.mu.Unlock()
	if !paused {
		return nil
	}
	err := g.control(ctx, "resume", "")
	g.open(version)
	return err
}

// open ends a pause at version.
func (g *Gate) open(version int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused {
		g.metrics.pausedFor(time.Since(g.since))
		g.pausedFor += time.Since(g.since)
		g.paused = false
		g.mode = ""
		close(g.resumed)
	}
	g.version = version
	g.metrics.setPaused(false)
	g.metrics.setVersion(version)
}

// enter waits until the gate is open and admits one attempt: its context
// is ctx, cut when an abort pause comes. held is the time spent waiting.
func (g *Gate) enter(ctx context.Context) (t *gateTicket, actx context.Context, held time.Duration, err error) {
	var t0 time.Time
	for {
		g.mu.Lock()
		if !g.paused {
			t = &gateTicket{version: g.version}
			actx, t.cancel = context.WithCancelCause(ctx)
			g.inflight[t] = struct{}{}
			g.mu.Unlock()
			if !t0.IsZero() {
				held = time.Since(t0)
				g.metrics.held(held)
			}
			return t, actx, held, nil
		}
		wait := g.resumed
		g.held++
		g.metrics.holding(g.held)
		g.mu.Unlock()
		if t0.IsZero() {
			t0 = time.Now()
		}
		select {
		case <-wait:
		case <-ctx.Done():
		}
		g.mu.Lock()
		g.held--
		g.metrics.holding(g.held)
		g.mu.Unlock()
		if ctx.Err() != nil {
			return nil, nil, time.Since(t0), context.Cause(ctx)
		}
	}
}

// leave ends an attempt and returns the version in force as it ended: the
// version that produced its answer.
func (g *Gate) leave(t *gateTicket) int64 {
	t.cancel(nil)
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.inflight, t)
	if len(g.inflight) == 0 {
		for _, d := range g.drained {
			close(d)
		}
		g.drained = nil
	}
	return g.version
}

// counted notes a recorded call's version for the per-version counts.
func (g *Gate) counted(version int64) { g.metrics.call(version) }

// control forwards a pause (mode set) or resume to every engine at once.
func (g *Gate) control(ctx context.Context, op string, mode PauseMode) error {
	engines := g.engineList()
	if op == "resume" {
		// Every engine the pause reached is resumed, in the set or not.
		g.mu.Lock()
		for e, st := range g.states {
			if st.Paused && !slices.Contains(engines, e) {
				engines = append(engines, e)
			}
		}
		g.mu.Unlock()
	}
	results := make([]EngineState, len(engines))
	var wg sync.WaitGroup
	for i, e := range engines {
		wg.Go(func() { results[i] = g.controlOne(ctx, e, op, mode) })
	}
	wg.Wait()
	failed := map[string]string{}
	g.mu.Lock()
	for _, st := range results {
		g.states[st.BaseURL] = st
		if st.Error != "" {
			failed[st.BaseURL] = st.Error
		}
	}
	g.mu.Unlock()
	if len(failed) > 0 {
		return &EngineError{Op: op, Engines: failed}
	}
	return nil
}

// controlOne pauses or resumes one engine: vLLM's endpoints first, then
// SGLang's; an engine with neither is left to the gate.
func (g *Gate) controlOne(ctx context.Context, base, op string, mode PauseMode) EngineState {
	st := EngineState{BaseURL: base, Paused: op == "pause"}
	root, err := engineRoot(base)
	if err != nil {
		st.Error = err.Error()
		return st
	}
	g.mu.Lock()
	known := g.states[base].API
	g.mu.Unlock()

	type try struct {
		api, path, body string
	}
	var tries []try
	if op == "pause" {
		tries = []try{
			{EngineAPIVLLM, "/pause?mode=" + url.QueryEscape(string(mode)), ""},
			// SGLang has no wait mode: by now nothing is in flight, so
			// in_place pauses an idle engine.
			{EngineAPISGLang, "/pause_generation", `{"mode":"` + sglangMode(mode) + `"}`},
		}
	} else {
		tries = []try{{EngineAPIVLLM, "/resume", ""}, {EngineAPISGLang, "/continue_generation", "{}"}}
	}
	for _, tr := range tries {
		if known != "" && known != tr.api {
			continue
		}
		status, detail, err := g.post(ctx, root+tr.path, tr.body)
		switch {
		case err != nil && op == "resume" && errors.Is(err, syscall.ECONNREFUSED):
			// Nothing listens there: the engine is gone, and one that
			// starts again starts unpaused. Nothing is left to resume.
			st.API = known
			return st
		case err != nil:
			st.API, st.Error = tr.api, err.Error()
			return st
		case status == http.StatusNotFound || status == http.StatusMethodNotAllowed:
			continue
		case status < 200 || status > 299:
			st.API, st.Error = tr.api, fmt.Sprintf("POST %s answered %d: %s", tr.path, status, detail)
			return st
		}
		st.API = tr.api
		return st
	}
	st.API = EngineAPINone
	return st
}

func (g *Gate) post(ctx context.Context, u, body string) (int, string, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, rd)
	if err != nil {
		return 0, "", err
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	return resp.StatusCode, drainSnippet(resp.Body), nil
}

func sglangMode(m PauseMode) string {
	switch m {
	case PauseAbort:
		return "abort"
	}
	return "in_place"
}

// engineRoot is the server root of an OpenAI base URL: http://h:8000/v1 →
// http://h:8000.
func engineRoot(base string) (string, error) {
	u, err := url.Parse(base)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("engine base URL %q is not an absolute URL", base)
	}
	u.Path = strings.TrimSuffix(strings.TrimSuffix(u.Path, "/"), "/v1")
	u.RawQuery, u.Fragment = "", ""
	return strings.TrimSuffix(u.String(), "/"), nil
}

// gateMetrics are the gate's collectors; nil is a no-op.
type gateMetrics struct {
	version  prometheus.Gauge
	paused   prometheus.Gauge
	pauseSec prometheus.Counter
	heldSec  prometheus.Histogram
	heldNow  prometheus.Gauge
	calls    *prometheus.CounterVec
}

func newGateMetrics(reg prometheus.Registerer) *gateMetrics {
	if reg == nil {
		return nil
	}
	m := &gateMetrics{
		version: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "osmo_llmproxy_policy_version",
			Help: "The policy version in force (set by the last resume).",
		}),
		paused: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "osmo_llmproxy_policy_paused",
			Help: "1 while the policy is paused for a weight update.",
		}),
		pauseSec: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "osmo_llmproxy_policy_paused_seconds_total",
			Help: "Time the policy spent paused, summed over finished pauses.",
		}),
		heldSec: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "osmo_llmproxy_policy_held_seconds",
			Help:    "Time a call waited at the pause gate before going upstream (calls that waited).",
			Buckets: prometheus.ExponentialBuckets(0.01, 4, 9),
		}),
		heldNow: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "osmo_llmproxy_policy_held_calls",
			Help: "Calls waiting at the pause gate now.",
		}),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llmproxy_calls_by_policy_version_total",
			Help: "Recorded calls that went upstream, by the policy version that answered them.",
		}, []string{"version"}),
	}
	reg.MustRegister(m.version, m.paused, m.pauseSec, m.heldSec, m.heldNow, m.calls)
	return m
}

func (m *gateMetrics) setVersion(v int64) {
	if m != nil {
		m.version.Set(float64(v))
	}
}

func (m *gateMetrics) setPaused(p bool) {
	if m == nil {
		return
	}
	if p {
		m.paused.Set(1)
	} else {
		m.paused.Set(0)
	}
}

func (m *gateMetrics) pausedFor(d time.Duration) {
	if m != nil {
		m.pauseSec.Add(d.Seconds())
	}
}

func (m *gateMetrics) held(d time.Duration) {
	if m != nil {
		m.heldSec.Observe(d.Seconds())
	}
}

func (m *gateMetrics) holding(n int) {
	if m != nil {
		m.heldNow.Set(float64(n))
	}
}

func (m *gateMetrics) call(v int64) {
	if m != nil {
		m.calls.WithLabelValues(strconv.FormatInt(v, 10)).Inc()
	}
}
