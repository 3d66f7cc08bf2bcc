package rollout

import (
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/sample"
)

// The grader callback's llm_calls keep the fields the wires have carried,
// each with the record's value, whatever the record gains: the token
// strings and the reason a call has no tokens stay osmo's own.
func TestWireCallFields(t *testing.T) {
	c := &osmo.LLMCall{
		RolloutID: "r1", SampleID: "s1", ID: "chatcmpl-1", RequestedModel: "gpt-x", Model: "policy",
		SharedRequestMessages: 1, RequestMessages: []json.RawMessage{json.RawMessage(`{"role":"user","content":"hi"}`)},
		ResponseMessage: json.RawMessage(`{"role":"assistant","content":"4"}`), FinishReason: "stop",
		Usage:     osmo.Usage{PromptTokens: 3, CompletionTokens: 2, TotalTokens: 5, CachedTokens: 1},
		LatencyMS: 1.5, TimeToFirstTokenMS: 0.5, Stream: true,
		PromptTokenIDs: []int32{1, 2, 3}, CompletionTokenIDs: []int32{4, 5}, Logprobs: []float64{-0.5, -0.25},
		CompletionTokenStrings: []string{"4", "<|im_end|>"}, NoTokensReason: "x",
		StatusCode: 200, Error: "e", Attempts: 2, StartedAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), API: "chat.completions",
	}
	sm := &sample.Sample{RolloutID: "r1", ID: "s1", LLMCalls: []*osmo.LLMCall{c}}
	b, err := json.Marshal(graderBody("r1", outcome.Outcome{}, []*sample.Sample{sm}))
	if err != nil {
		t.Fatal(err)
	}
	var body struct {
		Samples map[string]struct {
			LLMCalls []map[string]json.RawMessage `json:"llm_calls"`
		} `json:"samples"`
	}
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatal(err)
	}
	got := body.Samples["s1"].LLMCalls[0]
	want := []string{"api", "attempts", "cached_tokens", "completion_token_ids", "completion_tokens", "error", "finish_reason", "id",
		"latency_ms", "logprobs", "model", "model_name", "prompt_token_ids", "prompt_tokens", "request_messages", "requested_model",
		"response_message", "shared_request_messages", "started_at", "status_code", "stream", "time_to_first_token_ms", "usage"}
	if keys := slices.Sorted(maps.Keys(got)); !slices.Equal(keys, want) {
		t.Errorf("llm_calls[0] has %q, want %q", keys, want)
	}
	// Each value is the record's own encoding.
	rb, _ := json.Marshal(c)
	var rec map[string]json.RawMessage
	if err := json.Unmarshal(rb, &rec); err != nil {
		t.Fatal(err)
	}
	for k, v := range got {
		if r, ok := rec[k]; ok && string(r) != string(v) {
			t.Errorf("llm_calls[0].%s = %s, the record has %s", k, v, r)
		}
	}
	for k, g3 := range map[string]string{"prompt_tokens": "3", "completion_tokens": "2", "cached_tokens": "1", "model_name": `"policy"`} {
		if string(got[k]) != g3 {
			t.Errorf("llm_calls[0].%s = %s, want %s", k, got[k], g3)
		}
	}
}
