package rollout

import (
	"encoding/json"
	"math"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// TestGraderBodyJSON holds the grader callback's own encoding to what
// json.Marshal writes for it, byte for byte, across what a body can hold.
func TestGraderBodyJSON(t *testing.T) {
	msg := func(m map[string]any) *structpb.Struct {
		s, err := structpb.NewStruct(m)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	label, reward, agent := "42 <b>&</b>", 0.75, 1e-9
	full := &rolloutv1.RolloutSample{
		Id: "s-1 \u2028 日本", Label: &label, Reward: &reward,
		Messages: []*structpb.Struct{
			msg(map[string]any{"role": "user", "content": "What is <6> & \"7\"?\n"}),
			msg(map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": "c1", "function": map[string]any{"arguments": `{"a":6}`}}}}),
		},
		Metrics:     &rolloutv1.RolloutMetrics{TotalLatencyMs: 12.5, LlmLatencyMs: math.NaN(), ToolLatencyMs: math.Inf(1), NumLlmCalls: 2, PromptTokens: 30, MaxContextTokens: 4096},
		ExtraFields: msg(map[string]any{"k": []any{1.0, "x", true, nil}}),
		LlmCalls: []*rolloutv1.LLMCall{
			{Id: "c1", RequestedModel: "policy", Model: "m", RequestMessages: []*structpb.Struct{msg(map[string]any{"role": "user", "content": "hi"})},
				ResponseMessage: msg(map[string]any{"role": "assistant", "content": "ok"}), FinishReason: "stop",
				Usage:     &rolloutv1.Usage{PromptTokens: 3, CompletionTokens: 1, TotalTokens: 4, CachedTokens: 2},
				LatencyMs: 1.25, TimeToFirstTokenMs: math.Inf(-1), Stream: true, PromptTokenIds: []int32{1, -2, 3}, CompletionTokenIds: []int32{7},
				Logprobs: []float64{-0.5, 0, -1e-7}, StatusCode: 200, Attempts: 1, StartedAt: timestamppb.New(time.Date(2026, 11, 27, 1, 2, 3, 450000000, time.UTC)),
				Api: "chat.completions", PromptTokens: 3, CompletionTokens: 1, CachedTokens: 2, ModelName: "m"},
			{Id: "c2", SharedRequestMessages: 1, Logprobs: []float64{math.NaN(), -1}, StatusCode: 500, Error: "upstream <failed>"},
		},
	}
	removed := &rolloutv1.RolloutSample{Id: "s-2", RemoveSample: true, AgentReward: &agent}
	bare := &rolloutv1.RolloutSample{Id: "s-3", AgentReward: &agent}
	cases := map[string]*g2GraderCallback{
		"succeeded":  graderBody("r-1", outcome.Success(), []*rolloutv1.RolloutSample{full, removed, bare}),
		"failed":     graderBody("r-2", outcome.Failed(outcome.Timeout, "agent ran out of time <%d s>", 30), []*rolloutv1.RolloutSample{full}),
		"cancelled":  graderBody("r-3", outcome.CancelledBy("trainer"), nil),
		"no samples": graderBody("r-4", outcome.Success(), nil),
	}
	for name, body := range cases {
		t.Run(name, func(t *testing.T) {
			want, err := json.Marshal(body)
			if err != nil {
				t.Fatal(err)
			}
			got, err := marshalBody(body)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(want) {
				t.Errorf("appendJSON:\n%s\njson.Marshal:\n%s", got, want)
			}
		})
	}
}
