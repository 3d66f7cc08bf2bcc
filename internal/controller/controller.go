// Package controller is the trainer's side of osmo's three wires, written
// from PROTOCOL.md, for `osmo demo`, `osmo eval`, `osmo test`, the bench
// and the end-to-end tests. Each controller starts rollouts on a rollout
// server, relays the rollout's LLM calls to a policy endpoint, and records
// the callbacks, refusing what a reference trainer would refuse, so tests
// see a server's mistakes as failures:
//
//   - G1, the remote rollout (Controller): /v1/rollout/init, the trainer's
//     /v1/chat/completions and /v1/rollout/completed.
//   - G2, AgentWorkflow and Grader (G2): POST /rollout with the URLs to
//     call, then a completion and a grader callback.
//   - v0.3, G2 as today's SDK speaks it (V03): per-rollout URLs, a model
//     bridge under its own bearer, admission answered 202 or 429, one
//     sample per grader callback, and POST /rollout/cancel.
package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"
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
	// FailCompletions and FailFraction fail completion posts as
	// G2Options' FailCallbacks and FailFraction do.
	FailCompletions int
	FailStatus      int
	FailFraction    float64
	Logger          *slog.Logger
}

// Controller is a running G1 controller.
type Controller struct {
	*endpoint[Completion]
	opts Options
}

// New opens the controller's listener on addr (use 127.0.0.1:0 in tests).
func New(addr string, opts Options) (*Controller, error) {
	f := faults{first: opts.FailCompletions, firstField: "FailCompletions", fraction: opts.FailFraction, status: opts.FailStatus}
	e, err := newEndpoint[Completion]("controller.New", addr, opts.PolicyURL, f, opts.Logger, 5*time.Minute)
	if err != nil {
		return nil, err
	}
	c := &Controller{endpoint: e, opts: opts}
	e.mux.HandleFunc("POST /v1/chat/completions", e.chat(opts.APIKey, func(_ *http.Request, body map[string]any) (string, string) {
		if id, ok := body["rollout_id"].(string); ok {
			return id, ""
		}
		return "", "rollout_id missing from the request body"
	}))
	e.mux.HandleFunc("POST /v1/rollout/completed", c.completed)
	return c, nil
}

func (c *Controller) completed(w http.ResponseWriter, r *http.Request) {
	comp, ok := c.receive(w, r, kindCompletion, c.opts.APIKey, func(body []byte) (Completion, string, error) {
		var comp Completion
		if err := json.Unmarshal(body, &comp); err != nil {
			return comp, "", fmt.Errorf("body does not decode: %v", err)
		}
		if comp.RolloutID == "" {
			return comp, "", errors.New("rollout_id: required")
		}
		comp.Raw, comp.At = body, time.Now()
		return comp, comp.RolloutID, nil
	})
	if !ok || c.injectFailure(w) {
		return
	}
	c.record(kindCompletion, comp.RolloutID, comp)
	ack(w, `{"ok":true}`)
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
	code, _, data, err := c.post(ctx, baseURL, "/v1/rollout/init", serverKey, in.Header, in)
	return code, data, err
}

// Wait blocks until a completion for rolloutID arrived or ctx ends.
func (c *Controller) Wait(ctx context.Context, rolloutID string) (Completion, error) {
	return c.wait(ctx, kindCompletion, rolloutID)
}
