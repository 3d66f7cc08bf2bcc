package calculator_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// scripted plays the policy in process: it answers each chat completion
// with the next of a fixed sequence of assistant messages and keeps the
// messages it was sent, and it counts the tool calls recorded.
type scripted struct {
	replies []osmo.Message
	usage   int
	seen    [][]osmo.Message
	tools   int
}

func (s *scripted) Endpoint(string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: "http://policy.test/v1", HTTPClient: &http.Client{Transport: s}}
}
func (s *scripted) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (s *scripted) LogEvent(string, map[string]any)      {}
func (s *scripted) RecordToolCall(string, time.Duration) { s.tools++ }

func (s *scripted) RoundTrip(req *http.Request) (*http.Response, error) {
	var body struct {
		Messages []osmo.Message `json:"messages"`
	}
	if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
		return nil, err
	}
	s.seen = append(s.seen, body.Messages)
	if len(s.replies) == 0 {
		return answer(req, http.StatusInternalServerError, map[string]any{"error": map[string]any{"message": "no more replies"}}), nil
	}
	m := s.replies[0]
	s.replies = s.replies[1:]
	return answer(req, http.StatusOK, map[string]any{"id": "x", "choices": []any{map[string]any{"message": m, "finish_reason": "stop"}}, "usage": map[string]any{"completion_tokens": s.usage}}), nil
}

func answer(req *http.Request, status int, body any) *http.Response {
	b, _ := json.Marshal(body)
	return &http.Response{StatusCode: status, Body: io.NopCloser(bytes.NewReader(b)), Request: req}
}

// rolloutContext is the context the loop runs with, its policy played by rt.
func rolloutContext(req *osmo.RolloutRequest, tools []osmo.Tool, rt *scripted) *osmo.RolloutContext {
	return osmotest.NewRolloutContext(osmotest.NewRollout(req.RolloutID, rt), "calculator", req, tools)
}

func toolCall(id, name, args string) osmo.Message {
	return osmo.Message{"role": "assistant", "content": nil, "tool_calls": []any{
		map[string]any{"id": id, "type": "function", "function": map[string]any{"name": name, "arguments": args}},
	}}
}

func request(maxTurns, maxTokens int) *osmo.RolloutRequest {
	return &osmo.RolloutRequest{
		RolloutID: "r1", MaxTurns: maxTurns, MaxTokensTotal: maxTokens,
		Messages: []osmo.Message{{"role": "user", "content": "What is 6 * 7?"}},
	}
}

func TestRunUsesToolsAndStops(t *testing.T) {
	rt := &scripted{replies: []osmo.Message{
		toolCall("c1", "multiply", `{"a": 6, "b": 7}`),
		{"role": "assistant", "content": "The answer is 42.\n#### 42"},
	}}
	res, err := calculator.Loop{}.Run(context.Background(), rolloutContext(request(10, 8192), calculator.Tools(), rt))
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != osmo.StatusCompleted || res.FinishReason != "stop" {
		t.Fatalf("status %q finish %q", res.Status, res.FinishReason)
	}
	if got := len(res.FinalMessages); got != 4 {
		t.Fatalf("final messages = %d, want 4: %v", got, res.FinalMessages)
	}
	tool := res.FinalMessages[2]
	if tool["role"] != "tool" || tool["content"] != "42" || tool["tool_call_id"] != "c1" {
		t.Fatalf("tool result = %v", tool)
	}
	if rt.tools != 1 {
		t.Fatalf("recorded %d tool calls, want 1", rt.tools)
	}
	if len(rt.seen[1]) != 3 {
		t.Fatalf("second call saw %d messages, want the append-only history of 3", len(rt.seen[1]))
	}
	if res.Reward != nil {
		t.Fatalf("the loop must leave the reward to the grader, got %v", *res.Reward)
	}
}

func TestRunBudgetsAndBadArguments(t *testing.T) {
	t.Run("max_turns", func(t *testing.T) {
		rt := &scripted{replies: []osmo.Message{toolCall("c1", "add", `{"a":1,"b":2}`), toolCall("c2", "add", `{"a":1,"b":2}`)}}
		res, err := calculator.Loop{}.Run(context.Background(), rolloutContext(request(2, 8192), nil, rt))
		if err != nil || res.FinishReason != "max_turns" {
			t.Fatalf("res %+v err %v", res, err)
		}
	})
	t.Run("max_tokens", func(t *testing.T) {
		rt := &scripted{usage: 100, replies: []osmo.Message{toolCall("c1", "add", `{"a":1,"b":2}`)}}
		res, err := calculator.Loop{}.Run(context.Background(), rolloutContext(request(10, 50), nil, rt))
		if err != nil || res.FinishReason != "max_tokens" {
			t.Fatalf("res %+v err %v", res, err)
		}
	})
	t.Run("non-JSON arguments become a tool error naming the call", func(t *testing.T) {
		rt := &scripted{replies: []osmo.Message{toolCall("c9", "add", `{not json`), {"role": "assistant", "content": "sorry"}}}
		res, err := calculator.Loop{}.Run(context.Background(), rolloutContext(request(10, 8192), nil, rt))
		if err != nil {
			t.Fatal(err)
		}
		content, _ := res.FinalMessages[2]["content"].(string)
		if want := `Error: invalid arguments for tool "add" (call c9)`; len(content) < len(want) || content[:len(want)] != want {
			t.Fatalf("tool error = %q", content)
		}
	})
	t.Run("chat failure is an error", func(t *testing.T) {
		_, err := calculator.Loop{}.Run(context.Background(), rolloutContext(request(10, 8192), nil, &scripted{}))
		if err == nil {
			t.Fatal("want error")
		}
	})
}
