package grader

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// benchRequest is a multiply rollout's grading request: five messages, two
// recorded calls.
func benchRequest() *graderv1.GradeRequest {
	msg := func(m map[string]any) *structpb.Struct { s, _ := structpb.NewStruct(m); return s }
	msgs := []*structpb.Struct{
		msg(map[string]any{"role": "system", "content": "Use the multiply tool when arithmetic is required."}),
		msg(map[string]any{"role": "user", "content": "What is 6 times 7?"}),
		msg(map[string]any{"role": "assistant", "content": "", "tool_calls": []any{map[string]any{"id": "call_1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":6,"b":7}`}}}}),
		msg(map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "42"}),
		msg(map[string]any{"role": "assistant", "content": "6 times 7 is 42."}),
	}
	calls := []*rolloutv1.LLMCall{
		{Id: "c1", Model: "m", RequestMessages: msgs[:2], ResponseMessage: msgs[2], PromptTokenIds: []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, CompletionTokenIds: []int32{1, 2, 3, 4, 5}, Logprobs: []float64{-0.1, -0.2, -0.3, -0.4, -0.5}, Usage: &rolloutv1.Usage{PromptTokens: 10}},
		{Id: "c2", Model: "m", RequestMessages: msgs[2:4], SharedRequestMessages: 2, ResponseMessage: msgs[4], PromptTokenIds: []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, CompletionTokenIds: []int32{1, 2, 3, 4, 5}, Logprobs: []float64{-0.1, -0.2, -0.3, -0.4, -0.5}, Usage: &rolloutv1.Usage{PromptTokens: 10}},
	}
	md, _ := structpb.NewStruct(map[string]any{"row": 3.0, "split": "train"})
	l := "42"
	return &graderv1.GradeRequest{RolloutId: "r", Label: &l, Metadata: md, Samples: []*rolloutv1.RolloutSample{{Id: "s", Messages: msgs, LlmCalls: calls, Metrics: &rolloutv1.RolloutMetrics{NumLlmCalls: 2}}}}
}

// BenchmarkFingerprints compares fingerprints with the deterministic
// protobuf encoding of the same request, which it replaced.
func BenchmarkFingerprints(b *testing.B) {
	req := benchRequest()
	b.Run("fingerprints", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			fingerprints("g", req)
		}
	})
	b.Run("deterministic proto", func(b *testing.B) {
		b.ReportAllocs()
		opts := proto.MarshalOptions{Deterministic: true}
		for b.Loop() {
			if _, err := opts.Marshal(req); err != nil {
				b.Fatal(err)
			}
		}
	})
}
