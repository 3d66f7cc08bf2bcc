// Package controller is the trainer's side of the Osmosis remote-rollout (G1)
// protocol, written from PROTOCOL.md: it posts /v1/rollout/init, serves the
// rollout server's LLM calls by forwarding them to a policy endpoint, and
// collects completions. `osmo demo` and the end-to-end tests drive rollouts
// with it, and it checks what the rollout server sends on the way.
package controller

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/osmo-rl/osmo/internal/server"
)

// Completion is a received POST /v1/rollout/completed body.
type Completion struct {
	RolloutID     string           `json:"rollout_id"`
	Status        string           `json:"status"`
	FinalMessages []map[string]any `json:"final_messages"`
	FinishReason  string           `json:"finish_reason,omitempty"`
	ErrorMessage  string           `json:"error_message,omitempty"`
	Reward        *float64         `json:"reward,omitempty"`
	ExtraFields   map[string]any   `json:"extra_fields,omitempty"`
	Metrics       map[string]any   `json:"metrics,omitempty"`
	// Raw is the body as received, At when.
	Raw json.RawMessage `json:"-"`
	At  time.Time       `json:"-"`
}

// ChatCall is one LLM call the rollout server made to the controller.
type ChatCall struct {
	// RolloutID is the rollout the call's URL names (v0.3's bridge), else "".
	RolloutID string
	Header    http.Header
	Body      map[string]any
}

// Options configure a Controller.
type Options struct {
	// PolicyURL is the OpenAI base URL (ending in /v1) LLM calls are sent on to.
	PolicyURL string
	// APIKey is given to the rollout server in init; its calls back must carry it.
	APIKey string
	// FailCompletions makes the first N completion posts answer
	// FailStatus (default 503), to exercise the server's retries.
	FailCompletions int
	FailStatus      int
	// FailFraction makes that share of the well-formed completion posts
	// (after FailCompletions) answer FailStatus, picked at random: a flaky
	// trainer.
	FailFraction float64
	Logger       *slog.Logger
}

// Controller is a running G1 controller.
type Controller struct {
	opts   Options
	ln     net.Listener
	srv    *http.Server
	client *http.Client

	mu          sync.Mutex
	completions map[string][]Completion
	chats       []ChatCall
	failed      int
	down        bool
	changed     chan struct{} // closed and replaced on every new completion
}

// New opens the controller's listener on addr (use 127.0.0.1:0 in tests).
func New(addr string, opts Options) (*Controller, error) {
	if opts.PolicyURL == "" {
		return nil, fmt.Errorf("controller.New: PolicyURL is required")
	}
	if opts.FailStatus == 0 {
		opts.FailStatus = http.StatusServiceUnavailable
	}
	if opts.FailFraction < 0 || opts.FailFraction > 1 {
		return nil, fmt.Errorf("controller.New: FailFraction must be in [0, 1], got %v", opts.FailFraction)
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("controller.New: %w", err)
	}
	c := &Controller{
		opts:        opts,
		ln:          ln,
		client:      newClient(5 * time.Minute),
		completions: map[string][]Completion{},
		changed:     make(chan struct{}),
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", c.chat)
	mux.HandleFunc("POST /v1/rollout/completed", c.completed)
	c.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	return c, nil
}

// URL is the server_url to put in init requests.
func (c *Controller) URL() string { return "http://" + c.ln.Addr().String() }

// shutdownGrace is how long a controller, once its context ends, waits for
// the calls in progress (a callback being committed, a chat being answered)
// before cutting them.
const shutdownGrace = 5 * time.Second

// Serve runs until ctx ends, then shuts down, returning once the calls in
// progress have finished (or shutdownGrace is past).
func (c *Controller) Serve(ctx context.Context) error {
	// Its own idle connections go with it.
	defer c.client.CloseIdleConnections()
	if err := server.ServeHTTP(ctx, c.srv, c.ln, shutdownGrace); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	return nil
}

func (c *Controller) authorized(r *http.Request) bool {
	if c.opts.APIKey == "" {
		return true
	}
	got := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	return subtle.ConstantTimeCompare([]byte(got), []byte(c.opts.APIKey)) == 1
}

// chat checks and records an LLM call, then forwards it to the policy.
func (c *Controller) chat(w http.ResponseWriter, r *http.Request) {
	if !c.authorized(r) {
		http.Error(w, `{"detail":"bad api key"}`, http.StatusUnauthorized)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var parsed map[string]any
	if err := json.Unmarshal(body, &parsed); err != nil {
		http.Error(w, `{"detail":"malformed JSON"}`, http.StatusBadRequest)
		return
	}
	if _, ok := parsed["rollout_id"].(string); !ok {
		http.Error(w, `{"detail":"rollout_id missing from the request body"}`, http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	c.chats = append(c.chats, ChatCall{Header: r.Header.Clone(), Body: parsed})
	c.mu.Unlock()

	req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, strings.TrimRight(c.opts.PolicyURL, "/")+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range []string{"X-Rollout-Id", "X-Sample-Id", "Traceparent", "X-Mock-Fail"} {
		if v := r.Header.Get(h); v != "" {
			req.Header.Set(h, v)
		}
	}
	resp, err := c.client.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

func (c *Controller) completed(w http.ResponseWriter, r *http.Request) {
	if !c.authorized(r) {
		http.Error(w, `{"detail":"bad api key"}`, http.StatusUnauthorized)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var comp Completion
	if err := json.Unmarshal(body, &comp); err != nil || comp.RolloutID == "" {
		http.Error(w, `{"detail":"malformed completion"}`, http.StatusUnprocessableEntity)
		return
	}
	c.mu.Lock()
	if c.down || c.failed < c.opts.FailCompletions || (c.opts.FailFraction > 0 && rand.Float64() < c.opts.FailFraction) {
		c.failed++
		c.mu.Unlock()
		http.Error(w, `{"detail":"injected failure"}`, c.opts.FailStatus)
		return
	}
	comp.Raw, comp.At = body, time.Now()
	c.completions[comp.RolloutID] = append(c.completions[comp.RolloutID], comp)
	close(c.changed)
	c.changed = make(chan struct{})
	c.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{"ok":true}`))
}

// InitRequest is the G1 init body. Zero-valued optional fields are omitted.
type InitRequest struct {
	RolloutID        string           `json:"rollout_id"`
	ServerURL        string           `json:"server_url"`
	Messages         []map[string]any `json:"messages"`
	CompletionParams map[string]any   `json:"completion_params"`
	MaxTurns         int              `json:"max_turns,omitempty"`
	MaxTokensTotal   int              `json:"max_tokens_total,omitempty"`
	Metadata         map[string]any   `json:"metadata,omitempty"`
	APIKey           string           `json:"api_key,omitempty"`
	IdempotencyKey   string           `json:"idempotency_key,omitempty"`
	// Header is sent with the init request, not in its body: a trainer's
	// traceparent, say.
	Header http.Header `json:"-"`
}

// Init posts an init to the rollout server at baseURL, bearing serverKey, and
// returns the HTTP status and body. ServerURL and APIKey default to this
// controller's URL and key.
func (c *Controller) Init(ctx context.Context, baseURL, serverKey string, in InitRequest) (int, []byte, error) {
	if in.ServerURL == "" {
		in.ServerURL = c.URL()
	}
	if in.APIKey == "" {
		in.APIKey = c.opts.APIKey
	}
	if in.CompletionParams == nil {
		in.CompletionParams = map[string]any{"temperature": 1.0}
	}
	body, err := json.Marshal(in)
	if err != nil {
		return 0, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(baseURL, "/")+"/v1/rollout/init", bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	for k, v := range in.Header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	if serverKey != "" {
		req.Header.Set("Authorization", "Bearer "+serverKey)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	return resp.StatusCode, data, err
}

// Wait blocks until a completion for rolloutID arrived or ctx ends.
func (c *Controller) Wait(ctx context.Context, rolloutID string) (Completion, error) {
	for {
		c.mu.Lock()
		got := c.completions[rolloutID]
		changed := c.changed
		c.mu.Unlock()
		if len(got) > 0 {
			return got[0], nil
		}
		select {
		case <-ctx.Done():
			return Completion{}, fmt.Errorf("controller: waiting for completion of %q: %w", rolloutID, ctx.Err())
		case <-changed:
		}
	}
}

// Completions returns every completion received for rolloutID (a correct
// server sends exactly one).
func (c *Controller) Completions(rolloutID string) []Completion {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Completion(nil), c.completions[rolloutID]...)
}

// ChatCalls returns the LLM calls received so far.
func (c *Controller) ChatCalls() []ChatCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]ChatCall(nil), c.chats...)
}

// SetDown makes every completion post answer FailStatus (down) or lifts
// it: a trainer that is down for a while.
func (c *Controller) SetDown(down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down = down
}

// FailedCompletions is how many completion posts were answered with an
// injected failure.
func (c *Controller) FailedCompletions() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

// keepAliveConns is how many idle connections a controller keeps to each
// host (the rollout server, the policy): as many as it has calls in flight
// at once, as a trainer's pooled client does. Go's default keeps two, so
// that under load nearly every request opened a connection and closed it,
// a cost on both sides that no trainer pays.
const keepAliveConns = 1024

// newClient is a controller's HTTP client; timeout 0 is none.
func newClient(timeout time.Duration) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = keepAliveConns, keepAliveConns
	return &http.Client{Transport: tr, Timeout: timeout}
}
