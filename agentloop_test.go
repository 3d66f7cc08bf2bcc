package osmo_test

import (
	"context"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
)

// paramsRuntime records the parameters of each chat call.
type paramsRuntime struct{ params []map[string]any }

func (r *paramsRuntime) Chat(_ context.Context, _ []osmo.Message, p map[string]any) (*osmo.ChatResult, error) {
	r.params = append(r.params, p)
	return &osmo.ChatResult{Message: osmo.Message{"role": "assistant", "content": "ok"}, FinishReason: "stop"}, nil
}
func (r *paramsRuntime) RecordToolCall(time.Duration)    {}
func (r *paramsRuntime) LogEvent(string, map[string]any) {}

// TestChatParams: completion_params reach the policy under the caller's
// overrides, the tools are offered, and a stream is never asked for, since
// Chat returns whole completions (a trainer may set "stream": true).
func TestChatParams(t *testing.T) {
	rt := &paramsRuntime{}
	req := &osmo.RolloutRequest{CompletionParams: map[string]any{
		"temperature": 0.5, "max_tokens": 64, "stream": true, "stream_options": map[string]any{"include_usage": true},
	}}
	tools := []osmo.Tool{{"type": "function", "function": map[string]any{"name": "add"}}}
	c := osmo.NewRolloutContext(req, tools, rt)
	if _, err := c.Chat(context.Background(), []osmo.Message{{"role": "user", "content": "hi"}}, map[string]any{"temperature": 0.1, "stream": true}); err != nil {
		t.Fatal(err)
	}
	p := rt.params[0]
	if p["temperature"] != 0.1 || p["max_tokens"] != 64 {
		t.Errorf("params %v: want the call's temperature over completion_params, and max_tokens from them", p)
	}
	if _, ok := p["stream"]; ok {
		t.Errorf("params ask for a stream: %v", p)
	}
	if _, ok := p["stream_options"]; ok {
		t.Errorf("params carry stream_options: %v", p)
	}
	if got, ok := p["tools"].([]osmo.Tool); !ok || len(got) != 1 {
		t.Errorf("tools %v, want the loop's tools", p["tools"])
	}
	if req.CompletionParams["stream"] != true {
		t.Error("Chat changed the request's completion_params")
	}
}
