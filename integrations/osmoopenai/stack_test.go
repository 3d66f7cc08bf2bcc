package osmoopenai

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/osmo-rl/osmo/internal/gostack"
)

// stackPerGoroutine is the goroutine stack each of many goroutines holds
// once it ran f under about depth KiB of frames and waits.
func stackPerGoroutine(depth int, f func()) uint64 {
	return gostack.Held(200, func() { gostack.Under(depth, f) })
}

// TestRequestBodyKeepsTheCallersStack: encoding params (openai-go's
// encoder needs about 10 KiB of stack) does not grow the stack of the
// goroutine that asks, 10 KiB down, past 16 KiB: a rollout's goroutine
// holds whatever it grew to for as long as it waits for the policy.
func TestRequestBodyKeepsTheCallersStack(t *testing.T) {
	params := openai.ChatCompletionNewParams{Model: "m", Temperature: openai.Float(0.5), MaxTokens: openai.Int(100)}
	tool := Tool{Name: "multiply", Description: "Multiply two integers.", Parameters: map[string]any{
		"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
		"required": []any{"a", "b"}, "additionalProperties": false,
	}, Call: func(context.Context, json.RawMessage) (string, error) { return "42", nil }}
	items := []json.RawMessage{json.RawMessage(`{"role":"user","content":"What is 6 times 7?"}`)}
	body := func() {
		p := params
		if _, err := offer(&p, []Tool{tool}); err != nil {
			t.Error(err)
			return
		}
		enc, err := encodeOnce(&p, []Tool{tool})
		if err != nil {
			t.Error(err)
			return
		}
		if _, err := requestBody(&p, items, enc); err != nil {
			t.Error(err)
		}
		if _, err := requestBody(&p, items, nil); err != nil {
			t.Error(err)
		}
	}
	inline := func() {
		p := params
		if _, err := json.Marshal(&p); err != nil {
			t.Error(err)
		}
	}
	got := stackPerGoroutine(10, body)
	t.Logf("stack per goroutine: %d KiB (openai-go's encoder run inline instead: %d KiB)", got>>10, stackPerGoroutine(10, inline)>>10)
	if got > 24<<10 {
		t.Errorf("a goroutine that had a request body encoded 10 KiB down holds %d KiB of stack, want 16", got>>10)
	}
}

// TestReplyKeepsTheCallersStack: taking in a reply (openai-go's decoder
// needs over 12 KiB of stack) does not grow the stack of the goroutine
// that asks, 10 KiB down, past 16 KiB: the rollout then waits for the
// policy's next answer on that goroutine.
func TestReplyKeepsTheCallersStack(t *testing.T) {
	reply := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call-0","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]},"finish_reason":"tool_calls","logprobs":null}],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`)
	s := &Session{}
	took := func() {
		out, err := decodeCompletion(reply)
		if err != nil {
			t.Error(err)
			return
		}
		s.AddItems(replyParam(&out.Choices[0].Message))
	}
	inline := func() {
		var out openai.ChatCompletion
		if err := out.UnmarshalJSON(reply); err != nil {
			t.Error(err)
		}
	}
	got := stackPerGoroutine(10, took)
	t.Logf("stack per goroutine: %d KiB (openai-go's decoder run inline instead: %d KiB)", got>>10, stackPerGoroutine(10, inline)>>10)
	if got > 24<<10 {
		t.Errorf("a goroutine that took in a reply 10 KiB down holds %d KiB of stack, want 16", got>>10)
	}
}

// TestOffStackRaisesPanics: a panic on the helper goroutine is the
// caller's, as it would be inline.
func TestOffStackRaisesPanics(t *testing.T) {
	defer func() {
		if p := recover(); p != "boom" {
			t.Errorf("recovered %v, want boom", p)
		}
	}()
	offStack(func() { panic("boom") })
	t.Error("offStack returned")
}
