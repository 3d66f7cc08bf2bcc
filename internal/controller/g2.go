package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/osmo-rl/osmo"
)

// G2Options configure a G2 controller.
type G2Options struct {
	// PolicyURL is the OpenAI base URL (ending in /v1) LLM calls are sent on
	// to. Required.
	PolicyURL string
	// APIKey is the controller_api_key: when set, the rollout server's LLM
	// calls and callbacks must carry it as a bearer.
	APIKey string
	// FailCallbacks makes the first N well-formed callback posts answer
	// FailStatus (default 503), and FailFraction that share of the rest,
	// picked at random, to exercise the server's retries.
	FailCallbacks int
	FailStatus    int
	FailFraction  float64
	Logger        *slog.Logger
}

// G2Callback is a received completion or grader callback.
type G2Callback struct {
	Status      string  `json:"status"`
	RolloutID   string  `json:"rollout_id"`
	ErrMessage  *string `json:"err_message"`
	ErrCategory *string `json:"err_category"`
	// Samples is set on grader callbacks only.
	Samples map[string]G2Sample `json:"samples,omitempty"`
	// Raw is the body as received, At when.
	Raw    json.RawMessage `json:"-"`
	Header http.Header     `json:"-"`
	At     time.Time       `json:"-"`
}

// Sample is a graded sample as grader callbacks of both G2 and v0.3
// carry it.
type Sample struct {
	Messages     []map[string]any `json:"messages"`
	Label        *string          `json:"label"`
	Reward       *float64         `json:"reward"`
	RemoveSample bool             `json:"remove_sample"`
	Metrics      map[string]any   `json:"metrics"`
	ExtraFields  map[string]any   `json:"extra_fields"`
}

// G2Sample is one sample of a G2 grader callback: a Sample named by its
// id, with the LLM calls that made it, as the rollout server recorded them.
type G2Sample struct {
	ID string `json:"id"`
	Sample
	LLMCalls []osmo.LLMCall `json:"llm_calls"`
}

// G2 is a running controller of the G2 (AgentWorkflow) protocol: it refuses
// a wrong bearer, an LLM call without its id headers and a callback that is
// not the G2 shape.
type G2 struct {
	*endpoint[G2Callback]
	opts G2Options
}

// NewG2 opens the controller's listener on addr (use 127.0.0.1:0 in tests).
func NewG2(addr string, o G2Options) (*G2, error) {
	f := faults{first: o.FailCallbacks, firstField: "FailCallbacks", fraction: o.FailFraction, status: o.FailStatus}
	// No client timeout: a streamed answer may take long, and the caller's
	// request context bounds every forwarded call.
	e, err := newEndpoint[G2Callback]("controller.NewG2", addr, o.PolicyURL, f, o.Logger, 0)
	if err != nil {
		return nil, err
	}
	c := &G2{endpoint: e, opts: o}
	e.mux.HandleFunc("POST /v1/chat/completions", e.chat(o.APIKey, func(r *http.Request, _ map[string]any) (string, string) {
		for _, h := range [...]string{"X-Rollout-Id", "X-Sample-Id"} {
			if strings.TrimSpace(r.Header.Get(h)) == "" {
				return "", "missing " + h + " header"
			}
		}
		return r.Header.Get("X-Rollout-Id"), ""
	}))
	e.mux.HandleFunc("POST /callbacks/completion", func(w http.ResponseWriter, r *http.Request) { c.callback(w, r, kindCompletion) })
	e.mux.HandleFunc("POST /callbacks/grader", func(w http.ResponseWriter, r *http.Request) { c.callback(w, r, kindGrader) })
	return c, nil
}

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

// Start posts body to the rollout server's POST {serverURL}/rollout, bearing
// serverKey when it is not empty, and returns the answer. The body is sent
// as given (see StartBody), so malformed starts can be sent too.
func (c *G2) Start(ctx context.Context, serverURL, serverKey string, body map[string]any) (int, http.Header, []byte, error) {
	return c.StartWithHeader(ctx, serverURL, serverKey, nil, body)
}

// StartWithHeader is Start with extra request headers (a trainer's
// traceparent, say).
func (c *G2) StartWithHeader(ctx context.Context, serverURL, serverKey string, header http.Header, body map[string]any) (int, http.Header, []byte, error) {
	code, answerHeader, data, err := c.post(ctx, serverURL, "/rollout", serverKey, header, body)
	if err != nil {
		return code, answerHeader, data, fmt.Errorf("controller: start: %w", err)
	}
	return code, answerHeader, data, nil
}

// callback checks, records and acknowledges a completion or grader callback.
func (c *G2) callback(w http.ResponseWriter, r *http.Request, kind string) {
	cb, ok := c.receive(w, r, kind, c.opts.APIKey, func(body []byte) (G2Callback, string, error) {
		cb, err := parseCallback(body, kind)
		cb.Raw, cb.Header, cb.At = body, r.Header.Clone(), time.Now()
		return cb, cb.RolloutID, err
	})
	if !ok || c.injectFailure(w) {
		return
	}
	c.record(kind, cb.RolloutID, cb)
	ack(w, `{}`)
}

// g2Categories are the err_category values of the G2 wire.
var g2Categories = map[string]bool{"timeout": true, "validation_error": true, "http_error": true, "agent_error": true}

// parseCallback decodes a callback body and checks it against PROTOCOL.md.
// The callback carries the rollout id whenever it could be read, for logs.
func parseCallback(body []byte, kind string) (G2Callback, error) {
	var cb G2Callback
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		return cb, errors.New("body must be a JSON object")
	}
	// Each field is decoded from its own bytes: keys match exactly, as the
	// SDK's models read them, not in any case as a struct decoded whole would.
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
	if err := decodeFields(fields, field{"status", &cb.Status}, field{"rollout_id", &cb.RolloutID},
		field{"err_message", &cb.ErrMessage}, field{"err_category", &cb.ErrCategory}); err != nil {
		return cb, err
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
	err := decodeFields(raw, field{"id", &s.ID}, field{"messages", &s.Messages}, field{"label", &s.Label},
		field{"reward", &s.Reward}, field{"remove_sample", &s.RemoveSample}, field{"metrics", &s.Metrics},
		field{"extra_fields", &s.ExtraFields}, field{"llm_calls", &s.LLMCalls})
	return s, err
}

// field is a key of a JSON object and where its value decodes to.
type field struct {
	key string
	to  any
}

// decodeFields decodes each field present in raw from its own bytes.
func decodeFields(raw map[string]json.RawMessage, fields ...field) error {
	for _, f := range fields {
		if v, ok := raw[f.key]; ok {
			if err := json.Unmarshal(v, f.to); err != nil {
				return fmt.Errorf("%s: does not decode: %v", f.key, err)
			}
		}
	}
	return nil
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

// GraderCallbacks returns every grader callback received for rolloutID.
func (c *G2) GraderCallbacks(rolloutID string) []G2Callback {
	return c.received(kindGrader, rolloutID)
}
