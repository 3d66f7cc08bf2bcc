package osmo_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

// paramsRuntime plays the policy of every sample in process, recording the
// body of each chat completion posted to it.
type paramsRuntime struct{ bodies []map[string]any }

func (r *paramsRuntime) Endpoint(string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: "http://policy.test/v1", HTTPClient: &http.Client{Transport: r}}
}
func (r *paramsRuntime) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (r *paramsRuntime) LogEvent(string, map[string]any)      {}
func (r *paramsRuntime) RecordToolCall(string, time.Duration) {}

func (r *paramsRuntime) RoundTrip(req *http.Request) (*http.Response, error) {
	var body map[string]any
	if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
		return nil, err
	}
	r.bodies = append(r.bodies, body)
	answer := `{"choices":[{"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}`
	return &http.Response{StatusCode: http.StatusOK, Body: io.NopCloser(strings.NewReader(answer)), Request: req}, nil
}

// TestChatParams: completion_params reach the policy under the caller's
// overrides, the tools are offered, and a stream is never asked for, since
// Chat returns whole completions (a trainer may set "stream": true).
func TestChatParams(t *testing.T) {
	rt := &paramsRuntime{}
	req := &osmo.RolloutRequest{CompletionParams: map[string]any{
		"temperature": 0.5, "max_tokens": 64, "stream": true, "stream_options": map[string]any{"include_usage": true},
	}}
	tools := []osmo.Tool{{"type": "function", "function": map[string]any{"name": "add"}}}
	c := osmotest.NewRolloutContext(osmotest.NewRollout("r", rt), "agent", req, tools)
	if _, err := c.Chat(context.Background(), []osmo.Message{{"role": "user", "content": "hi"}}, map[string]any{"temperature": 0.1, "stream": true}); err != nil {
		t.Fatal(err)
	}
	p := rt.bodies[0]
	if p["temperature"] != 0.1 || p["max_tokens"] != 64.0 {
		t.Errorf("params %v: want the call's temperature over completion_params, and max_tokens from them", p)
	}
	if _, ok := p["stream"]; ok {
		t.Errorf("params ask for a stream: %v", p)
	}
	if _, ok := p["stream_options"]; ok {
		t.Errorf("params carry stream_options: %v", p)
	}
	if got, ok := p["tools"].([]any); !ok || len(got) != 1 {
		t.Errorf("tools %v, want the loop's tools", p["tools"])
	}
	if req.CompletionParams["stream"] != true {
		t.Error("Chat changed the request's completion_params")
	}
}
