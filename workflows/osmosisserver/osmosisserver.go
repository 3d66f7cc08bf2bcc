// Package osmosisserver hosts an Osmosis rollout server (a Python rollout
// of an Osmosis workspace, rollouts/NAME/main.py, unchanged) as an osmo
// workflow.
//
// A Host keeps Config.Procs server processes running (as `osmosis eval
// run` starts them), restarting one that dies. Its Workflow hands each
// rollout to the least busy process as the v0.3 controller does: a POST
// /rollout whose chat_completions_url and llm_api_key are the rollout's
// osmo proxy endpoint, whose controller_api_key is a secret of its own, and
// whose callbacks go to a loopback listener of the Host. The completion
// callback ends the agent's run; the grader callback gives the sample's
// messages, extra fields and the server's reward, the sample's agent
// reward unless osmo grades it too.
//
// A process that dies ends each rollout it held as an agent error; a
// rollout whose context ends is cancelled on its server.
package osmosisserver

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/retry"
	"github.com/osmo-rl/osmo/internal/rolloutproc"
)

// Defaults of Config.
const (
	DefaultProcs         = 1
	DefaultGraderTimeout = 30 * time.Second
	// DefaultAgentTimeout is agent_timeout_sec for a rollout without a
	// deadline (the SDK's agent_workflow_timeout_s).
	DefaultAgentTimeout = 450 * time.Second
	MinRestartBackoff   = 500 * time.Millisecond
	MaxRestartBackoff   = 30 * time.Second
)

// healthyRun is how long a process must run for its restart backoff to
// start over.
const healthyRun = 30 * time.Second

// Config configures a Host.
type Config struct {
	// Dir is the rollout directory (rollouts/NAME). Required.
	Dir string
	// Entrypoint is the file run in Dir; default "main.py".
	Entrypoint string
	// Name is the workflow's name and the id of each rollout's sample;
	// default the base name of Dir.
	Name string
	// Procs is how many server processes run; default 1.
	Procs   int
	Env     map[string]string // laid over the servers' environment
	Secrets []string          // redacted from the servers' output
	// Output receives the servers' output lines, prefixed with the
	// process's slot; nil logs them through Logger at info level.
	Output io.Writer
	// ReadyTimeout and StopGrace are rolloutproc's (defaults 90s and 5s).
	ReadyTimeout time.Duration
	StopGrace    time.Duration
	// GraderTimeout is grader_timeout_sec: the part of a rollout's budget
	// kept for the server's grader; default 30s, at most a quarter of the
	// budget.
	GraderTimeout time.Duration
	Logger        *slog.Logger
}

// Host runs the server processes and the callback listener.
type Host struct {
	cfg   Config
	log   *slog.Logger
	wf    *osmo.Workflow
	ln    net.Listener
	srv   *http.Server
	http  *http.Client
	slots []*slot

	mu      sync.Mutex
	changed chan struct{} // closed and replaced when a slot changes
	pending map[string]*pending
	stop    context.CancelFunc
	wg      sync.WaitGroup
}

// slot is one server process, restarted when it dies.
type slot struct {
	n        int
	srv      *rolloutproc.Server // nil while (re)starting; under Host.mu
	inflight int                 // under Host.mu
	restarts int                 // under Host.mu
}

// New checks cfg and builds the Host; nothing runs before Start.
func New(cfg Config) (*Host, error) {
	if cfg.Dir == "" {
		return nil, errors.New("osmosisserver: the rollout directory is required")
	}
	cfg.Entrypoint = cmp.Or(cfg.Entrypoint, rolloutproc.DefaultEntrypoint)
	if cfg.Name == "" {
		abs, err := filepath.Abs(cfg.Dir)
		if err != nil {
			return nil, fmt.Errorf("osmosisserver: %w", err)
		}
		cfg.Name = filepath.Base(abs)
	}
	if err := osmo.ValidSampleID(cfg.Name); err != nil {
		return nil, fmt.Errorf("osmosisserver: name: %w", err)
	}
	if cfg.Procs == 0 {
		cfg.Procs = DefaultProcs
	}
	if cfg.Procs < 0 {
		return nil, fmt.Errorf("osmosisserver: procs must be positive, got %d", cfg.Procs)
	}
	if cfg.GraderTimeout <= 0 {
		cfg.GraderTimeout = DefaultGraderTimeout
	}
	log := cmp.Or(cfg.Logger, slog.Default())
	h := &Host{
		cfg:     cfg,
		log:     log.With("osmosis_rollout", cfg.Name),
		http:    &http.Client{Timeout: 10 * time.Second},
		changed: make(chan struct{}),
		pending: map[string]*pending{},
	}
	for i := range cfg.Procs {
		h.slots = append(h.slots, &slot{n: i})
	}
	wf, err := osmo.NewWorkflow[struct{}](&runner{h: h}, nil)
	if err != nil {
		return nil, err
	}
	h.wf = wf
	return h, nil
}

// Workflow is the workflow that runs every rollout on the servers.
func (h *Host) Workflow() *osmo.Workflow { return h.wf }

// Name is the workflow's name and the sample id of its rollouts.
func (h *Host) Name() string { return h.cfg.Name }

// CallbackURL is the callback listener's base URL (after Start).
func (h *Host) CallbackURL() string { return "http://" + h.ln.Addr().String() }

// Start opens the callback listener and starts every server process,
// returning once each answered /health. A failed first start, or ctx
// ending first, fails Start and stops everything; later deaths are
// restarted. ctx bounds the start only: the processes run until Stop, so a
// server shutting down can drain its rollouts first.
func (h *Host) Start(ctx context.Context) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("osmosisserver: callback listener: %w", err)
	}
	h.ln = ln
	h.srv = &http.Server{Handler: http.HandlerFunc(h.callback), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = h.srv.Serve(ln) }()

	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	h.stop = cancel
	stopOnCtx := context.AfterFunc(ctx, cancel)
	first := make(chan error, len(h.slots))
	for _, sl := range h.slots {
		h.wg.Go(func() { h.supervise(runCtx, sl, first) })
	}
	var errs []error
	for range h.slots {
		if err := <-first; err != nil {
			errs = append(errs, err)
		}
	}
	stopOnCtx()
	if err := errors.Join(errs...); err != nil {
		_ = h.Stop(context.Background())
		return fmt.Errorf("osmosisserver: %w", err)
	}
	if err := ctx.Err(); err != nil {
		_ = h.Stop(context.Background())
		return fmt.Errorf("osmosisserver: start abandoned: %w", err)
	}
	h.log.Info("osmosis rollout servers ready", "procs", len(h.slots), "pids", h.PIDs(), "callbacks", h.CallbackURL())
	return nil
}

// Stop stops every server process (SIGTERM, then SIGKILL after the grace
// period; ctx ending kills at once) and the callback listener.
func (h *Host) Stop(ctx context.Context) error {
	if h.stop == nil {
		return nil
	}
	h.stop()
	var errs []error
	h.mu.Lock()
	servers := make([]*rolloutproc.Server, 0, len(h.slots))
	for _, sl := range h.slots {
		if sl.srv != nil {
			servers = append(servers, sl.srv)
		}
	}
	h.mu.Unlock()
	for _, s := range servers {
		errs = append(errs, s.Stop(ctx))
	}
	h.wg.Wait()
	errs = append(errs, h.srv.Close())
	return errors.Join(errs...)
}

// PIDs are the running server processes' ids, by slot (0 for one being
// restarted).
func (h *Host) PIDs() []int { return bySlot(h, (*rolloutproc.Server).PID) }

// URLs are the running server processes' base URLs, by slot ("" for one
// being restarted).
func (h *Host) URLs() []string { return bySlot(h, (*rolloutproc.Server).URL) }

func bySlot[T any](h *Host, f func(*rolloutproc.Server) T) []T {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]T, len(h.slots))
	for i, sl := range h.slots {
		if sl.srv != nil {
			out[i] = f(sl.srv)
		}
	}
	return out
}

// Restarts is how many times server processes were restarted.
func (h *Host) Restarts() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, sl := range h.slots {
		n += sl.restarts
	}
	return n
}

// notify wakes whoever waits for a slot to change. Caller holds mu.
func (h *Host) notify() {
	close(h.changed)
	h.changed = make(chan struct{})
}

// supervise keeps sl's process running until ctx ends. The first start's
// result goes to first.
func (h *Host) supervise(ctx context.Context, sl *slot, first chan<- error) {
	// Without jitter: one process restarting has no herd to spread.
	restarts := retry.Doubling(MinRestartBackoff, MaxRestartBackoff, 0)
	backoff := restarts.NextBackOff()
	log := h.log.With("slot", sl.n)
	for attempt := 0; ; attempt++ {
		srv, err := rolloutproc.Start(ctx, rolloutproc.Spec{
			Dir:        h.cfg.Dir,
			Entrypoint: h.cfg.Entrypoint,
			Env:        h.cfg.Env,
			// osmo's own bearer is never the rollout's business.
			Withhold:     []string{"OSMO_API_KEY"},
			Secrets:      h.cfg.Secrets,
			Output:       h.output(sl.n),
			ReadyTimeout: h.cfg.ReadyTimeout,
			StopGrace:    h.cfg.StopGrace,
			Logger:       log,
		})
		if attempt == 0 && err != nil {
			first <- err
			return
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			log.Error("osmosis rollout server failed to restart; trying again", "error", err, "backoff", backoff)
		} else {
			began := time.Now()
			h.mu.Lock()
			sl.srv = srv
			h.notify()
			h.mu.Unlock()
			if attempt == 0 {
				// Start returns once every slot holds its server.
				first <- nil
			}
			<-srv.Done()
			h.mu.Lock()
			sl.srv = nil
			h.notify()
			h.mu.Unlock()
			if ctx.Err() != nil {
				return
			}
			if time.Since(began) >= healthyRun {
				restarts.Reset()
				backoff = restarts.NextBackOff()
			}
			h.mu.Lock()
			sl.restarts++
			h.mu.Unlock()
			log.Error("osmosis rollout server died; restarting it", "pid", srv.PID(), "error", srv.Err(), "backoff", backoff)
		}
		if !sleep(ctx, backoff) {
			return
		}
		backoff = restarts.NextBackOff()
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// output is where slot n's output lines go.
func (h *Host) output(n int) io.Writer {
	return lineFunc(func(line string) {
		if h.cfg.Output != nil {
			fmt.Fprintf(h.cfg.Output, "[%s %d] %s\n", h.cfg.Name, n, line)
			return
		}
		h.log.Info("rollout server output", "slot", n, "line", line)
	})
}

// lineFunc receives rolloutproc's output, one line per Write.
type lineFunc func(string)

func (f lineFunc) Write(p []byte) (int, error) {
	f(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// acquire picks the least busy running process (waiting while none runs)
// and counts the rollout on it; release undoes it.
func (h *Host) acquire(ctx context.Context, avoid *rolloutproc.Server) (*slot, *rolloutproc.Server, error) {
	for {
		h.mu.Lock()
		var best *slot
		for _, sl := range h.slots {
			if sl.srv == nil || (sl.srv == avoid && len(h.slots) > 1) || exited(sl.srv) {
				continue
			}
			if best == nil || sl.inflight < best.inflight {
				best = sl
			}
		}
		if best != nil {
			best.inflight++
			srv := best.srv
			h.mu.Unlock()
			return best, srv, nil
		}
		changed := h.changed
		h.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("no osmosis rollout server was running: %w", context.Cause(ctx))
		}
	}
}

// exited reports whether srv's process is gone (about to be restarted).
func exited(srv *rolloutproc.Server) bool {
	select {
	case <-srv.Done():
		return true
	default:
		return false
	}
}

func (h *Host) release(sl *slot) {
	h.mu.Lock()
	sl.inflight--
	h.mu.Unlock()
}

// pending is a rollout waiting for the first callback of each kind.
type pending struct {
	rolloutID  string
	secret     string
	completion chan callbackBody
	grader     chan callbackBody
}

// callbackBody is either callback: the grader's carries the v0.3 sample or
// the G2 samples.
type callbackBody struct {
	Status      string                  `json:"status"`
	RolloutID   string                  `json:"rollout_id"`
	ErrMessage  *string                 `json:"err_message"`
	ErrCategory *string                 `json:"err_category"`
	Sample      *serverSample           `json:"sample"`
	Samples     map[string]serverSample `json:"samples"`
}

type serverSample struct {
	ID           string            `json:"id"`
	Messages     []json.RawMessage `json:"messages"`
	Reward       *float64          `json:"reward"`
	RemoveSample bool              `json:"remove_sample"`
	ExtraFields  map[string]any    `json:"extra_fields"`
	Metrics      json.RawMessage   `json:"metrics"`
}

// maxCallbackBytes bounds a callback body, which holds a whole conversation.
const maxCallbackBytes = 64 << 20

// callback serves POST /callbacks/{token}/completion and .../grader.
func (h *Host) callback(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if r.Method != http.MethodPost || len(parts) != 3 || parts[0] != "callbacks" || (parts[2] != "completion" && parts[2] != "grader") {
		writeDetail(w, http.StatusNotFound, "not found")
		return
	}
	h.mu.Lock()
	p := h.pending[parts[1]]
	h.mu.Unlock()
	if p == nil {
		writeDetail(w, http.StatusNotFound, "no such rollout (finished or never started)")
		return
	}
	auth, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if subtle.ConstantTimeCompare([]byte(auth), []byte(p.secret)) != 1 {
		writeDetail(w, http.StatusUnauthorized, "invalid or missing API key")
		return
	}
	data, err := io.ReadAll(io.LimitReader(r.Body, maxCallbackBytes+1))
	if err != nil || len(data) > maxCallbackBytes {
		writeDetail(w, http.StatusRequestEntityTooLarge, "callback body too large or unreadable")
		return
	}
	var body callbackBody
	if err := json.Unmarshal(data, &body); err != nil {
		writeDetail(w, http.StatusUnprocessableEntity, "callback body: "+err.Error())
		return
	}
	if body.RolloutID != "" && body.RolloutID != p.rolloutID {
		writeDetail(w, http.StatusUnprocessableEntity, fmt.Sprintf("rollout_id %q is not this callback's rollout", body.RolloutID))
		return
	}
	switch body.Status {
	case "success", "failure", "cancelled":
	default:
		writeDetail(w, http.StatusUnprocessableEntity, fmt.Sprintf("status %q is not terminal", body.Status))
		return
	}
	ch := p.completion
	if parts[2] == "grader" {
		ch = p.grader
	}
	select {
	case ch <- body:
	default: // not the first callback of its kind
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte("{}"))
}

func writeDetail(w http.ResponseWriter, code int, detail string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"detail": detail})
}

type runner struct{ h *Host }

func (r *runner) Name() string { return r.h.cfg.Name }

// ReadsLabel: the server's grader needs the row's label.
func (*runner) ReadsLabel() bool { return true }

// sample is the rollout's one sample: what the server reported, or (nil
// messages) what osmo's proxy recorded. It is read once Run returned.
type sample struct {
	messages []json.RawMessage
	extra    map[string]any
	reward   *float64
	finish   string
}

func (s *sample) SampleMessages() ([]json.RawMessage, error) { return s.messages, nil }
func (s *sample) SampleExtraFields() map[string]any          { return s.extra }
func (s *sample) SampleFinishReason() string                 { return s.finish }
func (s *sample) SampleAgentReward() *float64                { return s.reward }

func (r *runner) Run(ctx context.Context, wc *osmo.WorkflowContext[struct{}]) error {
	h := r.h
	id := wc.Rollout.ID
	smp := &sample{finish: "error"}
	if err := wc.Rollout.Register(h.cfg.Name, smp); err != nil {
		return err
	}
	ep := wc.Rollout.Endpoint(h.cfg.Name)
	if ep.BaseURL == "" {
		return errors.New("osmosisserver: the rollout has no LLM endpoint")
	}
	token := rand.Text()
	p := &pending{
		rolloutID:  id,
		secret:     rand.Text(),
		completion: make(chan callbackBody, 1),
		grader:     make(chan callbackBody, 1),
	}
	h.mu.Lock()
	h.pending[token] = p
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		delete(h.pending, token)
		h.mu.Unlock()
	}()

	agentBudget, graderBudget := h.budgets(ctx)
	cbBase := h.CallbackURL() + "/callbacks/" + token
	body := map[string]any{
		"rollout_id":              id,
		"initial_messages":        wc.Prompt,
		"chat_completions_url":    ep.BaseURL,
		"completion_callback_url": cbBase + "/completion",
		"label":                   wc.Label,
		"metadata":                wc.Metadata,
		"llm_api_key":             ep.APIKey,
		"controller_api_key":      p.secret,
		"agent_timeout_sec":       agentBudget.Seconds(),
		"grader_timeout_sec":      graderBudget.Seconds(),
	}
	// A server grades only a row with a label or metadata (PROTOCOL.md):
	// without either no grader callback would come, so none is asked for.
	graded := wc.Label != nil || wc.Metadata != nil
	if graded {
		body["grader_callback_url"] = cbBase + "/grader"
	}
	if ep.APIKey == "" {
		delete(body, "llm_api_key") // an empty llm_api_key is invalid
	}
	if wc.Prompt == nil {
		body["initial_messages"] = []osmo.Message{} // a list, never null
	}
	payload, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("osmosisserver: encode POST /rollout: %w: %w", osmo.ErrInvalidInput, err)
	}
	log := wc.Rollout.Logger()

	sl, srv, err := h.post(ctx, id, payload, log)
	if err != nil {
		return err
	}
	defer h.release(sl)
	log = log.With("rollout_server_pid", srv.PID())
	wc.Rollout.LogEvent("osmosis_rollout_posted", map[string]any{"pid": srv.PID(), "slot": sl.n})

	// wait waits for ch's callback (got), for timeout, for the server's
	// death (a callback that came just before it still counts), or for ctx.
	wait := func(ch <-chan callbackBody, timeout <-chan time.Time) (b callbackBody, got bool, err error) {
		select {
		case b = <-ch:
			return b, true, nil
		case <-srv.Done():
			select {
			case b = <-ch:
				return b, true, nil
			default:
				return b, false, fmt.Errorf("osmosisserver: the rollout server (pid %d) died while running the rollout: %v", srv.PID(), srv.Err())
			}
		case <-timeout:
			return b, false, nil
		case <-ctx.Done():
			h.cancel(srv, id, log)
			return b, false, fmt.Errorf("osmosisserver: %w", context.Cause(ctx))
		}
	}
	done, _, err := wait(p.completion, nil)
	if err != nil {
		return err
	}
	if err := callbackError("rollout server", done); err != nil {
		return err
	}
	var gb callbackBody
	got := false
	if graded {
		// A server without a grader never posts the callback: it is waited
		// for the grader's budget and a little more, but not past the
		// rollout's deadline, so such a rollout still ends as a success.
		patience := graderBudget + 5*time.Second
		if dl, ok := ctx.Deadline(); ok {
			patience = max(min(patience, time.Until(dl)-500*time.Millisecond), 0)
		}
		t := time.NewTimer(patience)
		defer t.Stop()
		if gb, got, err = wait(p.grader, t.C); err != nil {
			return err
		}
		if !got {
			// The proxy's record stands for the sample, with no reward.
			log.Warn("osmosis rollout server sent no grader callback in time; the sample has no reward", "waited", patience)
		} else if err := callbackError("rollout server's grader", gb); err != nil {
			return err
		}
	}
	smp.finish = "stop"
	if !got {
		return nil
	}
	sample, ok := pickSample(gb, log)
	if !ok {
		return nil
	}
	if len(sample.Messages) > 0 {
		smp.messages = sample.Messages
	}
	smp.extra = sample.ExtraFields
	if sample.Reward != nil {
		if math.IsNaN(*sample.Reward) || math.IsInf(*sample.Reward, 0) {
			return fmt.Errorf("osmosisserver: the rollout server's reward is not finite: %v", *sample.Reward)
		}
		smp.reward = sample.Reward
	}
	if sample.RemoveSample {
		log.Info("the rollout server's grader removed the sample; osmo keeps it without a reward")
		smp.reward = nil
	}
	return nil
}

// budgets splits what is left of the rollout's time into agent_timeout_sec
// and grader_timeout_sec: the grader gets GraderTimeout, at most a quarter,
// and a second is kept for the callbacks.
func (h *Host) budgets(ctx context.Context) (agent, grader time.Duration) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return DefaultAgentTimeout, h.cfg.GraderTimeout
	}
	left := time.Until(deadline)
	grader = min(h.cfg.GraderTimeout, left/4)
	agent = left - grader - time.Second
	return max(agent, time.Second), max(grader, time.Second)
}

// pickSample is the sample of a grader callback: the v0.3 "sample", else
// the first by id of the G2 "samples" (osmo registers one sample per
// hosted rollout; the rest are logged).
func pickSample(b callbackBody, log *slog.Logger) (serverSample, bool) {
	if b.Sample != nil {
		return *b.Sample, true
	}
	if len(b.Samples) == 0 {
		return serverSample{}, false
	}
	ids := slices.Sorted(maps.Keys(b.Samples))
	if len(ids) > 1 {
		log.Warn("the rollout server reported several samples; osmo keeps the first", "kept", ids[0], "dropped", ids[1:])
	}
	return b.Samples[ids[0]], true
}

// callbackError is a failed or cancelled callback as the rollout's error.
func callbackError(who string, b callbackBody) error {
	if b.Status == "success" {
		return nil
	}
	msg := "no message"
	if b.ErrMessage != nil && *b.ErrMessage != "" {
		msg = *b.ErrMessage
	}
	category := ""
	if b.ErrCategory != nil {
		category = *b.ErrCategory
	}
	if b.Status == "cancelled" {
		return fmt.Errorf("osmosisserver: the %s cancelled the rollout: %s", who, msg)
	}
	err := fmt.Errorf("osmosisserver: the %s reported %s: %s", who, cmp.Or(category, "failure"), msg)
	switch category {
	case "validation_error":
		return fmt.Errorf("%w: %w", osmo.ErrInvalidInput, err)
	case "timeout":
		return fmt.Errorf("%w: %w", osmo.ErrTimeout, err)
	}
	// http_error: the failed call went through osmo's proxy, which
	// recorded it; the rollout service names the category from it.
	return err
}

// post sends POST /rollout to the least busy process until one accepts it:
// a 429 waits Retry-After, a process that does not answer (dying) is left
// for another, and a 422 is the rollout's input.
func (h *Host) post(ctx context.Context, id string, payload []byte, log *slog.Logger) (*slot, *rolloutproc.Server, error) {
	var avoid *rolloutproc.Server
	for attempt := 0; ; attempt++ {
		sl, srv, err := h.acquire(ctx, avoid)
		if err != nil {
			return nil, nil, fmt.Errorf("osmosisserver: %w", err)
		}
		code, header, data, err := h.postOnce(ctx, srv.URL()+"/rollout", payload)
		if err == nil && code == http.StatusAccepted {
			log.Debug("osmosis rollout server accepted the rollout", "pid", srv.PID())
			return sl, srv, nil
		}
		h.release(sl)
		switch {
		case err == nil && code == http.StatusUnprocessableEntity:
			return nil, nil, fmt.Errorf("osmosisserver: the rollout server refused the rollout: %w: %s", osmo.ErrInvalidInput, snippet(data))
		case err == nil && code == http.StatusTooManyRequests:
			wait := retryAfter(header.Get("Retry-After"))
			log.Info("osmosis rollout server at capacity; waiting", "pid", srv.PID(), "retry_after", wait)
			if !sleep(ctx, wait) {
				return nil, nil, fmt.Errorf("osmosisserver: every rollout server was at capacity: %w", context.Cause(ctx))
			}
		case err != nil && ctx.Err() == nil && attempt < 5:
			// The process is likely dying; its slot restarts it.
			log.Warn("osmosis rollout server did not take the rollout; trying another", "pid", srv.PID(), "error", err)
			avoid = srv
			if !sleep(ctx, 100*time.Millisecond*time.Duration(attempt+1)) {
				return nil, nil, fmt.Errorf("osmosisserver: %w", context.Cause(ctx))
			}
		case err != nil:
			return nil, nil, fmt.Errorf("osmosisserver: POST /rollout to the rollout server (pid %d): %w", srv.PID(), err)
		default:
			return nil, nil, fmt.Errorf("osmosisserver: POST /rollout: the rollout server (pid %d) answered %d, not 202: %s", srv.PID(), code, snippet(data))
		}
	}
}

func (h *Host) postOnce(ctx context.Context, url string, payload []byte) (int, http.Header, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := h.http.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, resp.Header, data, nil
}

// cancel asks the server to cancel the rollout, without waiting.
func (h *Host) cancel(srv *rolloutproc.Server, id string, log *slog.Logger) {
	payload, _ := json.Marshal(map[string]any{"ids": []string{id}})
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		code, _, data, err := h.postOnce(ctx, srv.URL()+"/rollout/cancel", payload)
		if err != nil || code != http.StatusOK {
			log.Warn("osmosis rollout server: cancel failed", "code", code, "error", err, "body", snippet(data))
			return
		}
		log.Info("osmosis rollout server: rollout cancelled", "answer", snippet(data))
	}()
}

func retryAfter(v string) time.Duration {
	if s, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && s > 0 {
		return min(time.Duration(s)*time.Second, 30*time.Second)
	}
	return time.Second
}

func snippet(b []byte) string {
	b = bytes.TrimSpace(b)
	if len(b) > 300 {
		return string(b[:300]) + "..."
	}
	return string(b)
}
