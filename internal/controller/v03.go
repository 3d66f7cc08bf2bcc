package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// V03Options configure a V03 controller.
type V03Options struct {
	// PolicyURL is the OpenAI base URL (ending in /v1) the model bridge
	// forwards LLM calls to. Required.
	PolicyURL string
	// UpstreamKey is the bearer sent to PolicyURL (none when empty).
	UpstreamKey string
	// Model, when set, replaces the "model" of every bridged call, as a
	// local eval routes the placeholder to its TOML's model.
	Model string
	// CallbackKey is the controller_api_key, the bearer the rollout server
	// must present on both callbacks. Required: with an empty one the
	// server's callbacks would fail as a hang, not an error.
	CallbackKey string
	// LLMKey is the model bridge's own bearer, sent as llm_api_key; empty,
	// the bridge takes CallbackKey and the start has no llm_api_key.
	LLMKey string
	// CallbackTimeout bounds how long Run waits for the terminal callback
	// (0: no bound). When it runs out the rollout ends as a failure,
	// "callback_timeout", and POST /rollout/cancel is sent for it.
	CallbackTimeout time.Duration
	// OnTerminal, when set, is called with the result before the grader
	// callback is acknowledged (a local eval journals here); an error
	// answers 500 and keeps the rollout open for the server's retry.
	OnTerminal func(ctx context.Context, r V03Result) error
	// BeforeCall, when set, is called before the bridge forwards a call of
	// rolloutID (an interactive stepper holds a rollout between turns
	// here); an error refuses the call with 503.
	BeforeCall func(ctx context.Context, rolloutID string, body map[string]any) error
	// FailCallbacks and FailFraction fail callback posts for known
	// rollouts as G2Options' do.
	FailCallbacks int
	FailStatus    int
	FailFraction  float64
	// RetryAdmission, when set, is asked about every answer to POST
	// /rollout but 202 and 429 (code 0: no answer). When it says yes, Run
	// posts the start again after a pause (the answer's Retry-After, if
	// any), as a trainer that resubmits with the same id, since the start
	// may have been taken before the answer was lost. Unset, as in the
	// SDK's controller, such an answer ends Run with a *V03ProtocolError
	// (or the transport error).
	RetryAdmission func(code int) bool
	Logger         *slog.Logger
}

// V03RunRequest is one rollout as Run posts it.
type V03RunRequest struct {
	// RolloutID is required: one safe path segment.
	RolloutID        string
	Messages         []map[string]any
	Label            *string
	Metadata         map[string]any
	AgentTimeoutSec  *float64
	GraderTimeoutSec *float64
	ExtraFields      map[string]any
	// Header is sent with the start (a traceparent that makes the rollout
	// part of the caller's trace, say).
	Header http.Header
}

// V03Sample is the sample of a grader callback, as the v0.3 model reads it;
// Raw keeps the fields it does not know (a server's id or llm_calls).
type V03Sample struct {
	Sample
	Raw json.RawMessage `json:"-"`
}

// V03Callback is an accepted completion or grader callback.
type V03Callback struct {
	Status      string         `json:"status"`
	RolloutID   *string        `json:"rollout_id"`
	ErrMessage  *string        `json:"err_message"`
	ErrCategory *string        `json:"err_category"`
	ExtraFields map[string]any `json:"extra_fields"`
	// Sample is set on grader callbacks only, when the body has one.
	Sample *V03Sample `json:"-"`
	// Raw is the body as received, At when.
	Raw    json.RawMessage `json:"-"`
	Header http.Header     `json:"-"`
	At     time.Time       `json:"-"`
}

// V03Result is how a rollout ended for the controller.
type V03Result struct {
	RolloutID string
	// Source is what ended it: SourceGrader, SourceTimeout (CallbackTimeout
	// ran out) or SourceCancelled (Run's context ended).
	Source string
	// Status is the grader callback's, failure after a timeout, or cancelled.
	Status string
	// Sample is the grader callback's sample: nil on failure.
	Sample      *V03Sample
	ErrMessage  *string
	ErrCategory *string
	// Completion is the completion callback received before the end, if any.
	Completion *V03Callback
}

// V03ProtocolError is an answer to POST /rollout outside the v0.3
// admission contract (only 202 and 429 are).
type V03ProtocolError struct {
	StatusCode int
	Body       string
}

func (e *V03ProtocolError) Error() string {
	return fmt.Sprintf("POST /rollout answered %d (only 202 and 429 are accepted): %s", e.StatusCode, strings.TrimSpace(e.Body))
}

// V03 is the trainer's side of the v0.3 wire (PROTOCOL.md, "G3 as today's
// SDK speaks it"), as strict as the SDK's own controller. A rollout ends
// with its grader callback. Each Run drives one rollout, concurrently.
type V03 struct {
	*endpoint[V03Callback]
	opts V03Options

	// sessionsMu guards the rollouts' lifecycle, apart from the log.
	sessionsMu sync.Mutex
	live       map[string]*v03Session
	finished   map[string]V03Result // ended rollouts: late callbacks are acknowledged
	tokens     map[string]int
}

// v03Session is a rollout Run waits for.
type v03Session struct {
	completion *V03Callback
	done       chan V03Result // receives the terminal result once
	committing bool           // OnTerminal runs for a grader callback
}

// Terminal sources of a V03Result.
const (
	SourceGrader    = "grader"
	SourceTimeout   = "timeout"
	SourceCancelled = "cancelled"
)

// NewV03 opens the controller's listener on addr (use 127.0.0.1:0).
func NewV03(addr string, o V03Options) (*V03, error) {
	if strings.TrimSpace(o.CallbackKey) == "" {
		return nil, errors.New("controller.NewV03: CallbackKey must be a non-blank string")
	}
	f := faults{first: o.FailCallbacks, firstField: "FailCallbacks", fraction: o.FailFraction, status: o.FailStatus}
	// No client timeout: the caller's contexts bound every call.
	e, err := newEndpoint[V03Callback]("controller.NewV03", addr, o.PolicyURL, f, o.Logger, 0)
	if err != nil {
		return nil, err
	}
	e.unauthorized = "Unauthorized" // the SDK listener's word
	c := &V03{
		endpoint: e,
		opts:     o,
		live:     map[string]*v03Session{},
		finished: map[string]V03Result{},
		tokens:   map[string]int{},
	}
	e.mux.HandleFunc("POST /v1/rollouts/{id}/chat/completions", c.bridge)
	e.mux.HandleFunc("POST /v1/rollouts/{id}/completion", func(w http.ResponseWriter, r *http.Request) { c.callback(w, r, kindCompletion) })
	e.mux.HandleFunc("POST /v1/rollouts/{id}/grader", func(w http.ResponseWriter, r *http.Request) { c.callback(w, r, kindGrader) })
	return c, nil
}

// ChatCompletionsURL is the chat_completions_url of id: clients append
// /chat/completions.
func (c *V03) ChatCompletionsURL(id string) string {
	return c.URL() + "/v1/rollouts/" + url.PathEscape(id)
}

// CompletionURL is the completion_callback_url of id.
func (c *V03) CompletionURL(id string) string { return c.ChatCompletionsURL(id) + "/completion" }

// GraderURL is the grader_callback_url of id.
func (c *V03) GraderURL(id string) string { return c.ChatCompletionsURL(id) + "/grader" }

// singleSegment reports whether id can be one URL path segment, as the
// SDK requires of rollout ids.
func singleSegment(id string) bool {
	return id != "" && id != "." && id != ".." && !strings.ContainsAny(id, "/\\\x00")
}

// Run drives one rollout: it registers the id, posts POST
// {serverURL}/rollout (bearing serverKey when not empty), retrying a 429
// after its Retry-After, and waits for the terminal callback. Any other
// answer than 202 and 429 is a *V03ProtocolError. When ctx ends first the
// rollout ends as cancelled, POST /rollout/cancel is sent for it, and the
// result comes with ctx's error.
func (c *V03) Run(ctx context.Context, serverURL, serverKey string, r V03RunRequest) (V03Result, error) {
	id := r.RolloutID
	if !singleSegment(id) {
		return V03Result{}, fmt.Errorf("controller: rollout id %q is not one path segment", id)
	}
	sess := &v03Session{done: make(chan V03Result, 1)}
	c.sessionsMu.Lock()
	if _, dup := c.live[id]; dup {
		c.sessionsMu.Unlock()
		return V03Result{}, fmt.Errorf("controller: rollout %q is already running", id)
	}
	delete(c.finished, id)
	c.live[id] = sess
	c.sessionsMu.Unlock()

	if err := c.admit(ctx, serverURL, serverKey, r.Header, c.StartBody(r)); err != nil {
		if ctx.Err() != nil {
			// The server may have taken it before the answer was lost.
			c.end(id, V03Result{RolloutID: id, Source: SourceCancelled, Status: "cancelled"})
			c.cancelOne(serverURL, serverKey, id)
		} else {
			// Refused: it never started, and its id is unknown again.
			c.sessionsMu.Lock()
			delete(c.live, id)
			c.sessionsMu.Unlock()
		}
		return V03Result{RolloutID: id}, err
	}
	var timeout <-chan time.Time
	if c.opts.CallbackTimeout > 0 {
		t := time.NewTimer(c.opts.CallbackTimeout)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case res := <-sess.done:
		return res, nil
	case <-timeout:
		msg := "callback_timeout"
		if c.end(id, V03Result{RolloutID: id, Source: SourceTimeout, Status: "failure", ErrMessage: &msg}) {
			c.cancelOne(serverURL, serverKey, id)
			return c.result(id), nil
		}
	case <-ctx.Done():
		if c.end(id, V03Result{RolloutID: id, Source: SourceCancelled, Status: "cancelled"}) {
			c.cancelOne(serverURL, serverKey, id)
			return c.result(id), ctx.Err()
		}
	}
	// A grader callback is being committed: its result is the one.
	select {
	case res := <-sess.done:
		return res, nil
	case <-ctx.Done():
		return V03Result{RolloutID: id}, ctx.Err()
	}
}

// StartBody is the POST /rollout body Run sends for r: its URLs on this
// controller, its keys. A test that resubmits a rollout Run is driving
// (through another server, say) posts it as is.
func (c *V03) StartBody(r V03RunRequest) map[string]any {
	id := r.RolloutID
	body := map[string]any{
		"rollout_id":              id,
		"initial_messages":        nonNil(r.Messages),
		"label":                   r.Label,
		"metadata":                r.Metadata,
		"chat_completions_url":    c.ChatCompletionsURL(id),
		"controller_api_key":      c.opts.CallbackKey,
		"completion_callback_url": c.CompletionURL(id),
		"grader_callback_url":     c.GraderURL(id),
		"agent_timeout_sec":       r.AgentTimeoutSec,
		"grader_timeout_sec":      r.GraderTimeoutSec,
		"extra_fields":            r.ExtraFields,
	}
	if c.opts.LLMKey != "" {
		body["llm_api_key"] = c.opts.LLMKey
	}
	return body
}

func nonNil(msgs []map[string]any) []map[string]any {
	if msgs == nil {
		return []map[string]any{}
	}
	return msgs
}

// Retry-After bounds, as the SDK's driver has them: a floor so "0" does
// not spin, a ceiling so an outsized header does not park a rollout.
const (
	retryAfterFloor   = 50 * time.Millisecond
	retryAfterCeiling = 60 * time.Second
	retryAfterDefault = time.Second
)

// admit posts the start until the server takes it (202) or refuses it.
func (c *V03) admit(ctx context.Context, serverURL, serverKey string, header http.Header, body map[string]any) error {
	// Encoded once: a body that cannot be is no reason to retry.
	payload, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("controller: encode start: %w", err)
	}
	for {
		code, answerHeader, answer, err := c.post(ctx, serverURL, "/rollout", serverKey, header, json.RawMessage(payload))
		var pause time.Duration
		switch {
		case err != nil && ctx.Err() == nil && c.opts.RetryAdmission != nil && c.opts.RetryAdmission(0):
			pause = admissionRetryPause
		case err != nil:
			return fmt.Errorf("controller: POST /rollout: %w", err)
		case code == http.StatusAccepted:
			return nil
		case code == http.StatusTooManyRequests:
			pause = retryAfter(answerHeader.Get("Retry-After"))
		case c.opts.RetryAdmission != nil && c.opts.RetryAdmission(code):
			pause = admissionRetryPause
			if v := answerHeader.Get("Retry-After"); v != "" {
				pause = retryAfter(v)
			}
		default:
			return &V03ProtocolError{StatusCode: code, Body: string(answer)}
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// admissionRetryPause is the wait before a start RetryAdmission retries
// when the answer gave no Retry-After.
const admissionRetryPause = 100 * time.Millisecond

// retryAfter reads a Retry-After in seconds, bounded; a missing or bad one
// is retryAfterDefault.
func retryAfter(v string) time.Duration {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return retryAfterDefault
	}
	return min(max(time.Duration(f*float64(time.Second)), retryAfterFloor), retryAfterCeiling)
}

// Cancel posts POST {serverURL}/rollout/cancel {"ids": ids} and returns the
// dispositions.
func (c *V03) Cancel(ctx context.Context, serverURL, serverKey string, ids []string) (map[string]string, error) {
	code, _, data, err := c.post(ctx, serverURL, "/rollout/cancel", serverKey, nil, map[string]any{"ids": ids})
	if err != nil {
		return nil, fmt.Errorf("controller: cancel: %w", err)
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("controller: cancel: HTTP %d: %s", code, bytes.TrimSpace(data))
	}
	var out struct {
		Dispositions map[string]string `json:"dispositions"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("controller: cancel: malformed answer: %w", err)
	}
	return out.Dispositions, nil
}

// cancelOne is the best-effort teardown after a timeout or cancellation.
func (c *V03) cancelOne(serverURL, serverKey, id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Cancel(ctx, serverURL, serverKey, []string{id}); err != nil {
		c.logger.Warn("controller: cancel after the rollout ended here", "rollout_id", id, "error", err)
	}
}

// end makes res the result of id unless a grader callback ended it or is
// committing it; it reports whether res won.
func (c *V03) end(id string, res V03Result) bool {
	c.sessionsMu.Lock()
	defer c.sessionsMu.Unlock()
	sess := c.live[id]
	if sess == nil || sess.committing {
		return false
	}
	res.Completion = sess.completion
	delete(c.live, id)
	c.finished[id] = res
	return true
}

func (c *V03) result(id string) V03Result {
	c.sessionsMu.Lock()
	defer c.sessionsMu.Unlock()
	return c.finished[id]
}

// bridge serves a rollout's LLM calls: it checks the bearer and forwards
// the whole body (logprobs, token ids and all) to the policy, relaying the
// answer as it arrives so streams stay streams.
func (c *V03) bridge(w http.ResponseWriter, r *http.Request) {
	key := c.opts.LLMKey
	if key == "" {
		key = c.opts.CallbackKey
	}
	body, parsed, ok := c.readCall(w, r, key)
	if !ok {
		return
	}
	id := r.PathValue("id")
	if !singleSegment(id) {
		writeDetail(w, http.StatusUnprocessableEntity, "invalid rollout_id")
		return
	}
	c.recordChat(ChatCall{RolloutID: id, Header: r.Header.Clone(), Body: parsed})
	if c.opts.BeforeCall != nil {
		if err := c.opts.BeforeCall(r.Context(), id, parsed); err != nil {
			writeDetail(w, http.StatusServiceUnavailable, err.Error())
			return
		}
	}
	if c.opts.Model != "" {
		parsed["model"] = c.opts.Model
		body, _ = json.Marshal(parsed)
	}
	// A whole answer is read to count its tokens.
	c.relay(w, r, id, c.opts.UpstreamKey, body, func(answer []byte) {
		var usage struct {
			Usage struct {
				TotalTokens int `json:"total_tokens"`
			} `json:"usage"`
		}
		if json.Unmarshal(answer, &usage) == nil && usage.Usage.TotalTokens > 0 {
			c.sessionsMu.Lock()
			c.tokens[id] += usage.Usage.TotalTokens
			c.sessionsMu.Unlock()
		}
	})
}

// The v0.3 model's enums.
var (
	v03Statuses       = map[string]bool{"queued": true, "running": true, "grading": true, "success": true, "failure": true, "cancelled": true, "unknown": true}
	v03GraderStatuses = map[string]bool{"pending": true, "success": true, "failure": true}
	terminalStatus    = map[string]map[string]bool{
		kindCompletion: {"success": true, "failure": true, "cancelled": true},
		kindGrader:     {"success": true, "failure": true},
	}
)

// callback receives a completion or grader callback, checking in the order
// the SDK's listener does: the bearer (401), the path id (422), the body
// against the model (422), the body's id against the path's (422), a
// terminal status (422), a known rollout (404).
func (c *V03) callback(w http.ResponseWriter, r *http.Request, kind string) {
	id := r.PathValue("id")
	cb, ok := c.receive(w, r, kind, c.opts.CallbackKey, func(body []byte) (V03Callback, string, error) {
		if !singleSegment(id) {
			return V03Callback{}, id, errors.New("invalid rollout_id")
		}
		cb, err := parseV03Callback(body, kind)
		if err == nil && cb.RolloutID != nil && *cb.RolloutID != id {
			err = errors.New("rollout_id mismatch")
		}
		if err == nil && !terminalStatus[kind][cb.Status] {
			err = fmt.Errorf("%s callback status must be terminal", kind)
		}
		cb.Raw, cb.Header, cb.At = body, r.Header.Clone(), time.Now()
		return cb, id, err
	})
	if !ok {
		return
	}
	c.sessionsMu.Lock()
	_, ended := c.finished[id]
	known := c.live[id] != nil || ended
	c.sessionsMu.Unlock()
	if !known {
		writeDetail(w, http.StatusNotFound, "unknown rollout_id")
		return
	}
	if c.injectFailure(w) {
		return
	}
	c.record(kind, id, cb)

	c.sessionsMu.Lock()
	sess := c.live[id]
	if kind == kindCompletion {
		if sess != nil && sess.completion == nil {
			sess.completion = &cb
		}
		c.sessionsMu.Unlock()
		ack(w, `{"ok":true}`)
		return
	}
	if sess == nil || sess.committing {
		// Ended already (or ending): a duplicate is acknowledged, as the
		// SDK's store acknowledges callbacks for a finalized rollout.
		c.sessionsMu.Unlock()
		ack(w, `{"ok":true}`)
		return
	}
	res := V03Result{RolloutID: id, Source: SourceGrader, Status: cb.Status, Sample: cb.Sample,
		ErrMessage: cb.ErrMessage, ErrCategory: cb.ErrCategory, Completion: sess.completion}
	sess.committing = true
	c.sessionsMu.Unlock()

	if c.opts.OnTerminal != nil {
		if err := c.opts.OnTerminal(r.Context(), res); err != nil {
			// Not durable: the rollout stays open for the server's retry.
			c.sessionsMu.Lock()
			sess.committing = false
			c.sessionsMu.Unlock()
			c.unrecord(kindGrader, id)
			c.logger.ErrorContext(r.Context(), "controller: committing the result failed", "rollout_id", id, "error", err)
			writeDetail(w, http.StatusInternalServerError, "commit failed: "+err.Error())
			return
		}
	}
	c.sessionsMu.Lock()
	delete(c.live, id)
	c.finished[id] = res
	c.sessionsMu.Unlock()
	sess.done <- res
	ack(w, `{"ok":true}`)
}

// parseV03Callback decodes a callback body as the v0.3 pydantic models do:
// known enums, optional fields typed when present, unknown fields ignored.
func parseV03Callback(body []byte, kind string) (V03Callback, error) {
	var cb V03Callback
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		return cb, errors.New("body must be a JSON object")
	}
	if err := json.Unmarshal(body, &cb); err != nil {
		return cb, fmt.Errorf("body does not match the model: %v", err)
	}
	statuses := v03Statuses
	if kind == kindGrader {
		statuses = v03GraderStatuses
	}
	if !statuses[cb.Status] {
		return cb, fmt.Errorf("status: %q is not a valid %s status", cb.Status, kind)
	}
	if cb.ErrCategory != nil && !g2Categories[*cb.ErrCategory] {
		return cb, fmt.Errorf("err_category: %q is not timeout, validation_error, http_error or agent_error", *cb.ErrCategory)
	}
	raw, ok := fields["sample"]
	if kind != kindGrader || !ok || string(raw) == "null" {
		return cb, nil
	}
	var s V03Sample
	if err := json.Unmarshal(raw, &s); err != nil {
		return cb, fmt.Errorf("sample: does not match the model: %v", err)
	}
	if s.Reward != nil && (math.IsNaN(*s.Reward) || math.IsInf(*s.Reward, 0)) {
		return cb, errors.New("sample.reward: must be finite")
	}
	if s.Messages == nil {
		s.Messages = []map[string]any{}
	}
	s.Raw = raw
	cb.Sample = &s
	return cb, nil
}

// GraderCallbacks returns every grader callback accepted for id.
func (c *V03) GraderCallbacks(id string) []V03Callback {
	return c.received(kindGrader, id)
}

// Tokens is the total_tokens the policy reported for id's unstreamed calls.
func (c *V03) Tokens(id string) int {
	c.sessionsMu.Lock()
	defer c.sessionsMu.Unlock()
	return c.tokens[id]
}
