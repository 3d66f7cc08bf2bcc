package llmproxy

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo"
)

// policyAnswer is a policy's answer with a tool call, token ids, logprobs
// and cached tokens.
const policyAnswer = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"4","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":2,\"b\":2}"}}]},"logprobs":{"content":[{"token":"4","logprob":-0.25,"bytes":[52],"top_logprobs":[{"token":"4","logprob":-0.25}]},{"token":"","logprob":-1e-3}]},"finish_reason":"tool_calls","token_ids":[19,2]}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}},"prompt_token_ids":[1,2,3]}`

func TestRecordCompletion(t *testing.T) {
	for _, tt := range []struct {
		body string
		want osmo.LLMCall
	}{
		{policyAnswer, osmo.LLMCall{
			ID: "chatcmpl-1", FinishReason: "tool_calls",
			ResponseMessage:        json.RawMessage(`{"role":"assistant","content":"4","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":2,\"b\":2}"}}]}`),
			Usage:                  osmo.Usage{PromptTokens: 12, CompletionTokens: 2, TotalTokens: 14, CachedTokens: 8},
			PromptTokenIDs:         []int32{1, 2, 3},
			CompletionTokenIDs:     []int32{19, 2},
			Logprobs:               []float64{-0.25, -1e-3},
			CompletionTokenStrings: []string{"4", ""},
		}},
		// SGLang puts the prompt's ids on the choice.
		{`{"choices":[{"token_ids":[7,8],"prompt_token_ids":[4,5,6]}]}`,
			osmo.LLMCall{PromptTokenIDs: []int32{4, 5, 6}, CompletionTokenIDs: []int32{7, 8}}},
		// vLLM's, at the top level, win over a choice's.
		{`{"prompt_token_ids":[1],"choices":[{"prompt_token_ids":[2]}]}`, osmo.LLMCall{PromptTokenIDs: []int32{1}}},
		// Keys match in any case, as encoding/json matches them.
		{`{"ID":"x","ChoiCes":[{"fiNish_reason":"p"}]}`, osmo.LLMCall{ID: "x", FinishReason: "p"}},
		// A value of another type is skipped; the rest is read.
		{`{"id":"x","choices":[{"finish_reason":5,"token_ids":[1]}],"usage":{"prompt_tokens":"1","completion_tokens":2}}`,
			osmo.LLMCall{ID: "x", CompletionTokenIDs: []int32{1}, Usage: osmo.Usage{CompletionTokens: 2}}},
		// The record holds choice 0, wherever it is.
		{`{"choices":[{"index":1,"finish_reason":"a"},{"index":0,"finish_reason":"b"}]}`, osmo.LLMCall{FinishReason: "b"}},
		{`{"choices":[{"message":null}],"usage":null}`, osmo.LLMCall{}},
	} {
		var c osmo.LLMCall
		if err := recordCompletion(&c, []byte(tt.body)); err != nil {
			t.Fatalf("%s: %v", tt.body, err)
		}
		if !reflect.DeepEqual(c, tt.want) {
			t.Errorf("%s recorded\n%+v\nwant\n%+v", tt.body, c, tt.want)
		}
	}
	for _, body := range []string{``, `[]`, `null`, `"x"`, `{"id":`, `{} x`} {
		if err := recordCompletion(&osmo.LLMCall{}, []byte(body)); err == nil {
			t.Errorf("%q recorded, want an error", body)
		}
	}
}

// The message is the body's bytes, copied: the body's buffer is reused.
func TestRecordCompletionCopiesTheMessage(t *testing.T) {
	body := []byte(`{"choices":[{"message":{"content":"a"}}]}`)
	var c osmo.LLMCall
	if err := recordCompletion(&c, body); err != nil {
		t.Fatal(err)
	}
	copy(body, strings.Repeat("x", len(body)))
	if string(c.ResponseMessage) != `{"content":"a"}` {
		t.Errorf("message = %s after the body changed", c.ResponseMessage)
	}
}

// BenchmarkRecordCompletion reads a policy's answer into the record:
//
//	go test -run '^$' -bench RecordCompletion -benchmem ./pkg/llmproxy/
func BenchmarkRecordCompletion(b *testing.B) {
	body := []byte(policyAnswer)
	b.ReportAllocs()
	for b.Loop() {
		var c osmo.LLMCall
		if err := recordCompletion(&c, body); err != nil {
			b.Fatal(err)
		}
	}
}
