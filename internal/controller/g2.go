package controller

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/osmo-rl/osmo/internal/server"
)

// maxBody bounds what the controller reads of any request or answer body.
const maxBody = 64 << 20

// G2Options configure a G2 controller.
type G2Options struct {
	// PolicyURL is the OpenAI base URL (ending in /v1) LLM calls are sent on
	// to. Required.
	PolicyURL string
	// APIKey is the controller_api_key: when set, the rollout server's LLM
	// calls and callbacks must carry it as a bearer.
	APIKey string
	// FailCallbacks makes the first N well-formed callback posts (completion
	// and grader alike) answer FailStatus (default 503), to exercise the
	// server's retries.
	FailCallbacks int
	FailStatus    int
	// FailFraction makes that share of the well-formed callback posts (after
	// FailCallbacks) answer FailStatus, picked at random: a flaky trainer.
	FailFraction float64
	Logger       *slog.Logger
}

// G2Callback is a received completion or grader callback.
type G2Callback struct {
	Status      string  `json:"status"`
	RolloutID   string  `json:"rollout_id"`
	ErrMessage  *string `json:"err_message"`
	ErrCategory *string `json:"err_category"`
	// Samples is set on grader callbacks only.
	Samples map[string]G2Sample `json:"samples,omitempty"`
	// Raw is the body as received, Header the request's headers, At
	// when it was received.
	Raw    json.RawMessage `json:"-"`
	Header http.Header     `json:"-"`
	At     time.Time       `json:"-"`
}

// G2Sample is one sample of a grader callback.
type G2Sample struct {
	ID           string           `json:"id"`
	Messages     []map[string]any `json:"messages"`
	Label        *string          `json:"label"`
	Reward       *float64         `json:"reward"`
	RemoveSample bool             `json:"remove_sample"`
	Metrics      map[string]any   `json:"metrics"`
	ExtraFields  map[string]any   `json:"extra_fields"`
	LLMCalls     []map[string]any `json:"llm_calls"`
}

// G2 is a running controller of the G2 (AgentWorkflow) protocol, written
// from PROTOCOL.md: it starts rollouts with POST /rollout, serves the
// rollout server's LLM calls at /v1/chat/completions by forwarding them to
// a policy endpoint, and collects the completion and grader callbacks. It
// refuses whatever a reference controller would refuse (a wrong bearer, an
// LLM call without its id headers, a callback that is not the G2 shape), so
// tests see a server's mistakes as failures.
type G2 struct {
	opts   G2Options
	ln     net.Listener
	srv    *http.Server
	client *http.Client

	// inFlight counts LLM calls being relayed to the policy right now.
	inFlight atomic.Int64

	mu          sync.Mutex
	completions map[string][]G2Callback
	grades      map[string][]G2Callback
	chats       []ChatCall
	failed      int
	down        bool
	rejected    []string
	changed     chan struct{} // closed and replaced on every new callback
}

// Callback kinds.
const (
	kindCompletion = "completion"
	kindGrader     = "grader"
)

// NewG2 opens the controller's listener on addr (use 127.0.0.1:0 in tests).
func NewG2(addr string, o G2Options) (*G2, error) {
	if o.PolicyURL == "" {
		return nil, errors.New("controller.NewG2: PolicyURL is required")
	}
	if o.FailCallbacks < 0 {
		return nil, fmt.Errorf("controller.NewG2: FailCallbacks must not be negative, got %d", o.FailCallbacks)
	}
	if o.FailStatus == 0 {
		o.FailStatus = http.StatusServiceUnavailable
	}
	if o.FailFraction < 0 || o.FailFraction > 1 {
		return nil, fmt.Errorf("controller.NewG2: FailFraction must be in [0, 1], got %v", o.FailFraction)
	}
	if o.FailStatus < 400 || o.FailStatus > 599 {
		return nil, fmt.Errorf("controller.NewG2: FailStatus must be an HTTP error status (400-599), got %d", o.FailStatus)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("controller.NewG2: %w", err)
	}
	c := &G2{
		opts: o,
		ln:   ln,
		// No client timeout: a streamed answer may take long, and the
		// caller's request context bounds every forwarded call.
		client:      newClient(0),
		completions: map[string][]G2Callback{},
		grades:      map[string][]G2Callback{},
		changed:     make(chan struct{}),
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", c.chat)
	mux.HandleFunc("POST /callbacks/completion", func(w http.ResponseWriter, r *http.Request) { c.callback(w, r, kindCompletion) })
	mux.HandleFunc("POST /callbacks/grader", func(w http.ResponseWriter, r *http.Request) { c.callback(w, r, kindGrader) })
	c.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	return c, nil
}

// URL is the controller's base URL (http://host:port).
func (c *G2) URL() string { return "http://" + c.ln.Addr().String() }

// ChatCompletionsURL is the chat_completions_url to put in start requests;
// LLM calls arrive at POST {it}/chat/completions.
func (c *G2) ChatCompletionsURL() string { return c.URL() + "/v1" }

// CompletionURL is the completion_callback_url to put in start requests.
func (c *G2) CompletionURL() string { return c.URL() + "/callbacks/completion" }

// GraderURL is the grader_callback_url to put in start requests.
func (c *G2) GraderURL() string { return c.URL() + "/callbacks/grader" }

// StartBody is a G2 start body for rolloutID addressed to this controller:
// its URLs, and its API key when it has one. Add label, metadata, timeouts
// and extra_fields as needed.
func (c *G2) StartBody(rolloutID string, initialMessages []map[string]any) map[string]any {
	body := map[string]any{
		"rollout_id":              rolloutID,
		"initial_messages":        initialMessages,
		"chat_completions_url":    c.ChatCompletionsURL(),
		"completion_callback_url": c.CompletionURL(),
		"grader_callback_url":     c.GraderURL(),
	}
	if c.opts.APIKey != "" {
		body["controller_api_key"] = c.opts.APIKey
	}
	return body
}

// Serve runs until ctx ends, then shuts down, returning once the calls in
// progress have finished (or shutdownGrace is past): what they record is
// complete when it returns.
func (c *G2) Serve(ctx context.Context) error {
	// Its own idle connections go with it.
	defer c.client.CloseIdleConnections()
	if err := server.ServeHTTP(ctx, c.srv, c.ln, shutdownGrace); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	return nil
}

// Start posts body to the rollout server's POST {serverURL}/rollout, bearing
// serverKey when it is not empty, and returns the answer. The body is sent
// as given (see StartBody), so malformed starts can be sent too.
func (c *G2) Start(ctx context.Context, serverURL, serverKey string, body map[string]any) (int, http.Header, []byte, error) {
	return c.StartWithHeader(ctx, serverURL, serverKey, nil, body)
}

// StartWithHeader is Start with extra request headers (a trainer's
// traceparent, say).
func (c *G2) StartWithHeader(ctx context.Context, serverURL, serverKey string, header http.Header, body map[string]any) (int, http.Header, []byte, error) {
	payload, err := json.Marshal(body)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("controller: encode start body: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(serverURL, "/")+"/rollout", bytes.NewReader(payload))
	if err != nil {
		return 0, nil, nil, fmt.Errorf("controller: start: %w", err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	if serverKey != "" {
		req.Header.Set("Authorization", "Bearer "+serverKey)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("controller: start: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return resp.StatusCode, resp.Header, data, fmt.Errorf("controller: start: read answer: %w", err)
	}
	return resp.StatusCode, resp.Header, data, nil
}

func (c *G2) authorized(r *http.Request) bool {
	if c.opts.APIKey == "" {
		return true
	}
	h := r.Header.Get("Authorization")
	token, ok := strings.CutPrefix(h, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(token), []byte(c.opts.APIKey)) == 1
}

func writeDetail(w http.ResponseWriter, status int, detail string) {
	b, _ := json.Marshal(map[string]string{"detail": detail})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// forwardHeaders are passed from an LLM call on to the policy.
var forwardHeaders = [...]string{"X-Rollout-Id", "X-Sample-Id", "Traceparent", "X-Mock-Fail"}

// chat checks and records an LLM call, then forwards it to the policy and
// relays the answer as it arrives (so SSE streams stay streams).
func (c *G2) chat(w http.ResponseWriter, r *http.Request) {
	if !c.authorized(r) {
		writeDetail(w, http.StatusUnauthorized, "Invalid or missing API key")
		return
	}
	for _, h := range [...]string{"X-Rollout-Id", "X-Sample-Id"} {
		if strings.TrimSpace(r.Header.Get(h)) == "" {
			writeDetail(w, http.StatusBadRequest, "missing "+h+" header")
			return
		}
	}
	log := c.opts.Logger.With("rollout_id", r.Header.Get("X-Rollout-Id"), "sample_id", r.Header.Get("X-Sample-Id"))
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		writeDetail(w, http.StatusBadRequest, "reading body: "+err.Error())
		return
	}
	var parsed map[string]any
	if err := json.Unmarshal(body, &parsed); err != nil || parsed == nil {
		writeDetail(w, http.StatusBadRequest, "body must be a JSON object")
		return
	}
	c.mu.Lock()
	c.chats = append(c.chats, ChatCall{Header: r.Header.Clone(), Body: parsed})
	c.mu.Unlock()
	c.inFlight.Add(1)
	defer c.inFlight.Add(-1)

	req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, strings.TrimRight(c.opts.PolicyURL, "/")+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		writeDetail(w, http.StatusInternalServerError, err.Error())
		return
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range forwardHeaders {
		if v := r.Header.Get(h); v != "" {
			req.Header.Set(h, v)
		}
	}
	resp, err := c.client.Do(req)
	if err != nil {
		log.WarnContext(r.Context(), "controller: policy call failed", "error", err)
		writeDetail(w, http.StatusBadGateway, "policy: "+err.Error())
		return
	}
	defer resp.Body.Close()
	for _, h := range [...]string{"Content-Type", "Cache-Control", "Retry-After"} {
		if v := resp.Header.Get(h); v != "" {
			w.Header().Set(h, v)
		}
	}
	w.WriteHeader(resp.StatusCode)
	if err := copyFlushing(w, resp.Body); err != nil {
		log.DebugContext(r.Context(), "controller: relaying the policy's answer ended early", "error", err)
	}
}

// copyFlushing copies src to w, flushing after every read so each SSE
// event reaches the client when the policy sends it.
func copyFlushing(w http.ResponseWriter, src io.Reader) error {
	rc := http.NewResponseController(w)
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
			if ferr := rc.Flush(); ferr != nil {
				return ferr
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// callback checks, records and acknowledges a completion or grader callback.
func (c *G2) callback(w http.ResponseWriter, r *http.Request, kind string) {
	if !c.authorized(r) {
		writeDetail(w, http.StatusUnauthorized, "Invalid or missing API key")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		writeDetail(w, http.StatusBadRequest, "reading body: "+err.Error())
		return
	}
	cb, err := parseCallback(body, kind)
	if err != nil {
		c.opts.Logger.WarnContext(r.Context(), "controller: callback refused", "kind", kind, "rollout_id", cb.RolloutID, "error", err)
		c.mu.Lock()
		c.rejected = append(c.rejected, fmt.Sprintf("%s callback for %q: %v", kind, cb.RolloutID, err))
		c.mu.Unlock()
		writeDetail(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	cb.Raw, cb.Header, cb.At = body, r.Header.Clone(), time.Now()
	c.mu.Lock()
	if c.down || c.failed < c.opts.FailCallbacks || (c.opts.FailFraction > 0 && rand.Float64() < c.opts.FailFraction) {
		c.failed++
		c.mu.Unlock()
		writeDetail(w, c.opts.FailStatus, "injected failure")
		return
	}
	if kind == kindCompletion {
		c.completions[cb.RolloutID] = append(c.completions[cb.RolloutID], cb)
	} else {
		c.grades[cb.RolloutID] = append(c.grades[cb.RolloutID], cb)
	}
	close(c.changed)
	c.changed = make(chan struct{})
	c.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{}`))
}

// g2Categories are the err_category values of the G2 wire.
var g2Categories = map[string]bool{"timeout": true, "validation_error": true, "http_error": true, "agent_error": true}

// parseCallback decodes a callback body and checks it against PROTOCOL.md:
// every field present (null where it has no value), a known status (a
// grader callback's success or failure), an error message exactly when it
// did not succeed, and for grader callbacks samples keyed by their ids
// whose rewards are set only when grading succeeded. The returned
// callback carries the rollout id whenever it could be read, for logs.
func parseCallback(body []byte, kind string) (G2Callback, error) {
	var cb G2Callback
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		return cb, errors.New("body must be a JSON object")
	}
	// The body is scanned once: each field is decoded from its own bytes.
	// Keys match exactly (as the SDK's models read them), not in any case
	// as a struct decoded whole would.
	_ = json.Unmarshal(fields["rollout_id"], &cb.RolloutID) // for logs, before anything is refused
	required := []string{"status", "rollout_id", "err_message", "err_category"}
	if kind == kindGrader {
		required = append(required, "samples")
	}
	for _, k := range required {
		if _, ok := fields[k]; !ok {
			return cb, fmt.Errorf("%s: missing (send null for no value)", k)
		}
	}
	for _, f := range []struct {
		key string
		to  any
	}{{"status", &cb.Status}, {"rollout_id", &cb.RolloutID}, {"err_message", &cb.ErrMessage}, {"err_category", &cb.ErrCategory}} {
		if err := json.Unmarshal(fields[f.key], f.to); err != nil {
			return cb, fmt.Errorf("%s: does not decode: %v", f.key, err)
		}
	}
	if cb.RolloutID == "" && (cb.Status != "failure" || cb.ErrCategory == nil || *cb.ErrCategory != "validation_error") {
		// Only a start refused as bad input (its rollout_id blank, say)
		// reports an empty id.
		return cb, errors.New("rollout_id: must be a non-empty string (empty only for a validation_error failure)")
	}
	switch cb.Status {
	case "success":
		if cb.ErrMessage != nil || cb.ErrCategory != nil {
			return cb, errors.New("err_message, err_category: must be null on success")
		}
	case "failure":
		// err_category may be null (the SDK's model makes it optional): a
		// cancelled rollout's grader callback is a failure without one.
		if cb.ErrMessage == nil {
			return cb, errors.New("err_message: required on failure")
		}
	case "cancelled":
		// Only the completion may say it (a G3 addition); the grader
		// status of both SDK generations is pending, success or failure.
		if kind == kindGrader {
			return cb, errors.New(`status: "cancelled" is not a grader status (success or failure)`)
		}
	default:
		return cb, fmt.Errorf("status: %q is not success, failure or cancelled", cb.Status)
	}
	if cb.ErrCategory != nil && !g2Categories[*cb.ErrCategory] {
		return cb, fmt.Errorf("err_category: %q is not timeout, validation_error, http_error or agent_error", *cb.ErrCategory)
	}
	if kind != kindGrader {
		return cb, nil
	}
	if string(fields["samples"]) == "null" {
		return cb, errors.New("samples: must be an object keyed by sample id")
	}
	var samples map[string]map[string]json.RawMessage
	if err := json.Unmarshal(fields["samples"], &samples); err != nil {
		return cb, fmt.Errorf("samples: must be an object of sample objects: %v", err)
	}
	cb.Samples = make(map[string]G2Sample, len(samples))
	for id, raw := range samples {
		for _, k := range [...]string{"id", "messages", "label", "reward", "remove_sample", "metrics", "extra_fields"} {
			if _, ok := raw[k]; !ok {
				return cb, fmt.Errorf("samples[%q].%s: missing", id, k)
			}
		}
		s, err := parseSample(raw)
		if err != nil {
			return cb, fmt.Errorf("samples[%q].%w", id, err)
		}
		if s.ID != id {
			return cb, fmt.Errorf("samples[%q].id: %q does not match its key", id, s.ID)
		}
		if s.Messages == nil {
			return cb, fmt.Errorf("samples[%q].messages: must be an array of messages", id)
		}
		if s.Reward != nil && cb.Status != "success" {
			return cb, fmt.Errorf("samples[%q].reward: must be null when the rollout did not succeed", id)
		}
		cb.Samples[id] = s
	}
	return cb, nil
}

// parseSample decodes a grader callback's sample from its fields.
func parseSample(raw map[string]json.RawMessage) (G2Sample, error) {
	var s G2Sample
	for _, f := range []struct {
		key string
		to  any
	}{
		{"id", &s.ID}, {"messages", &s.Messages}, {"label", &s.Label}, {"reward", &s.Reward},
		{"remove_sample", &s.RemoveSample}, {"metrics", &s.Metrics}, {"extra_fields", &s.ExtraFields},
		{"llm_calls", &s.LLMCalls},
	} {
		if v, ok := raw[f.key]; ok {
			if err := json.Unmarshal(v, f.to); err != nil {
				return s, fmt.Errorf("%s: does not decode: %v", f.key, err)
			}
		}
	}
	return s, nil
}

// WaitCompletion blocks until a completion callback for rolloutID arrived
// or ctx ends, and returns the first one.
func (c *G2) WaitCompletion(ctx context.Context, rolloutID string) (G2Callback, error) {
	return c.wait(ctx, kindCompletion, rolloutID)
}

// WaitGrader blocks until a grader callback for rolloutID arrived or ctx
// ends, and returns the first one.
func (c *G2) WaitGrader(ctx context.Context, rolloutID string) (G2Callback, error) {
	return c.wait(ctx, kindGrader, rolloutID)
}

func (c *G2) wait(ctx context.Context, kind, rolloutID string) (G2Callback, error) {
	for {
		c.mu.Lock()
		got := c.completions[rolloutID]
		if kind == kindGrader {
			got = c.grades[rolloutID]
		}
		changed := c.changed
		rejected := c.rejected
		c.mu.Unlock()
		if len(got) > 0 {
			return got[0], nil
		}
		select {
		case <-ctx.Done():
			err := fmt.Errorf("controller: waiting for the %s callback of %q: %w", kind, rolloutID, ctx.Err())
			if len(rejected) > 0 {
				// A refused callback is the likely reason nothing arrived.
				err = fmt.Errorf("%w (refused so far: %s)", err, strings.Join(rejected, "; "))
			}
			return G2Callback{}, err
		case <-changed:
		}
	}
}

// Completions returns every completion callback received for rolloutID (a
// correct server posts exactly one).
func (c *G2) Completions(rolloutID string) []G2Callback {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]G2Callback(nil), c.completions[rolloutID]...)
}

// GraderCallbacks returns every grader callback received for rolloutID.
func (c *G2) GraderCallbacks(rolloutID string) []G2Callback {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]G2Callback(nil), c.grades[rolloutID]...)
}

// Chats returns the LLM calls received so far (those refused for a bad
// bearer or missing ids are not among them).
func (c *G2) Chats() []ChatCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]ChatCall(nil), c.chats...)
}

// InFlight is how many LLM calls the controller is relaying now: a call
// whose client went away (a cancelled rollout) ends and leaves this count.
func (c *G2) InFlight() int { return int(c.inFlight.Load()) }

// SetDown makes every callback post answer FailStatus (down) or lifts it:
// a trainer that is down for a while.
func (c *G2) SetDown(down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down = down
}

// FailedCallbacks is how many callback posts were answered with an
// injected failure.
func (c *G2) FailedCallbacks() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

// Rejected describes the callbacks refused as malformed (answered 422).
func (c *G2) Rejected() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.rejected...)
}
