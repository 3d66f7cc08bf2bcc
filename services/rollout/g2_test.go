package rollout

import (
	"encoding/json"
	"math"
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// The grader callback's samples are rendered field by field for one
// marshal; their JSON must be what the proto JSON form of the sample gives
// (every field, proto names, empty token lists left out), which is how the
// wires have it.
func TestWireSampleIsTheProtoJSONForm(t *testing.T) {
	msg := func(kv map[string]any) *structpb.Struct {
		s, err := structpb.NewStruct(kv)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	full := &rolloutv1.LLMCall{
		Id: "call-1", RequestedModel: "policy", Model: "policy-v2",
		RequestMessages: []*structpb.Struct{msg(map[string]any{"role": "user", "content": "2*21?"}),
			msg(map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": "t1", "n": 1.5e21}}})},
		ResponseMessage: msg(map[string]any{"role": "assistant", "content": "42"}),
		FinishReason:    "stop",
		Usage:           &rolloutv1.Usage{PromptTokens: 11, CompletionTokens: 3, TotalTokens: 14, CachedTokens: 2},
		LatencyMs:       12.25, TimeToFirstTokenMs: 0.000001, Stream: true,
		PromptTokenIds: []int32{1, 2, 3}, CompletionTokenIds: []int32{4},
		Logprobs:   []float64{-0.5, math.Inf(-1), math.NaN(), 1e-7},
		StatusCode: 200, Error: "", Attempts: 2,
		StartedAt: timestamppb.New(time.Date(2026, 11, 25, 14, 9, 11, 123400000, time.UTC)),
		Api:       "chat.completions", PromptTokens: 11, CompletionTokens: 3, CachedTokens: 2, ModelName: "policy-v2",
	}
	bare := &rolloutv1.LLMCall{Id: "call-2", StatusCode: 502, Error: "upstream: bad gateway", Logprobs: []float64{}}
	reward := 0.75
	label := "42"
	sample := &rolloutv1.RolloutSample{
		Id: "s1", Messages: []*structpb.Struct{msg(map[string]any{"role": "user", "content": "hi"})},
		Label: &label, Reward: &reward,
		Metrics:  &rolloutv1.RolloutMetrics{NumLlmCalls: 2, TotalLatencyMs: 3.5},
		LlmCalls: []*rolloutv1.LLMCall{full, bare},
	}
	for _, tc := range []struct {
		name string
		sm   *rolloutv1.RolloutSample
	}{{"full", sample}, {"empty", &rolloutv1.RolloutSample{Id: "s2"}}} {
		got := generic(t, newWireSample(tc.sm, true))
		want := generic(t, referenceSample(tc.sm))
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n got %v\nwant %v", tc.name, got, want)
		}
	}
	// And the callback as a whole encodes (NaN and infinities included).
	if _, err := marshalBody(graderBody("r1", outcome.Outcome{State: rolloutv1.State_STATE_SUCCEEDED}, []*rolloutv1.RolloutSample{sample})); err != nil {
		t.Fatal(err)
	}
}

// referenceSample is the sample's proto JSON form, through a map.
func referenceSample(sm *rolloutv1.RolloutSample) map[string]any {
	calls := []any{}
	// The callback's calls are as stored: request messages after those
	// shared with the previous call, which shared_request_messages counts.
	for _, c := range sm.GetLlmCalls() {
		m := protoMap(c)
		for _, k := range [...]string{"prompt_token_ids", "completion_token_ids", "logprobs"} {
			if v, ok := m[k].([]any); ok && len(v) == 0 {
				delete(m, k)
			}
		}
		calls = append(calls, m)
	}
	out := map[string]any{
		"id": sm.GetId(), "messages": fromStructs(sm.GetMessages()), "label": sm.Label, "reward": sm.Reward,
		"remove_sample": sm.GetRemoveSample(), "metrics": protoMap(sm.GetMetrics()), "extra_fields": sm.GetExtraFields().AsMap(),
	}
	if len(calls) > 0 {
		out["llm_calls"] = calls
	}
	return out
}

func generic(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// protoMap renders a message as a JSON object with the proto field names,
// the shape of the callbacks.
func protoMap(m proto.Message) map[string]any {
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(m)
	var out map[string]any
	if err != nil || json.Unmarshal(b, &out) != nil {
		return nil
	}
	return out
}

// The metrics are rendered as their proto JSON form through a map was,
// byte for byte.
func TestWireMetricsAreTheProtoJSONForm(t *testing.T) {
	for _, m := range []*rolloutv1.RolloutMetrics{nil, {}, {
		TotalLatencyMs: 1234.5678, LlmLatencyMs: 1e-7, ToolLatencyMs: 1.5e21, NumLlmCalls: 3, NumToolCalls: 2,
		PromptTokens: 120, ResponseTokens: 45, MaxContextTokens: 165,
	}, {TotalLatencyMs: math.NaN(), LlmLatencyMs: math.Inf(1), ToolLatencyMs: math.Inf(-1)}} {
		got, err := json.Marshal(newWireMetrics(m))
		if err != nil {
			t.Fatal(err)
		}
		want, err := json.Marshal(protoMap(m))
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Errorf("%v:\n got %s\nwant %s", m, got, want)
		}
	}
}

// A call's started_at is the proto JSON form of its timestamp.
func TestTimestampIsTheProtoJSONForm(t *testing.T) {
	for _, ts := range []*timestamppb.Timestamp{
		{}, {Seconds: 1764079751}, {Seconds: 1764079751, Nanos: 123000000}, {Seconds: 1764079751, Nanos: 123400000},
		{Seconds: 1764079751, Nanos: 123456000}, {Seconds: 1764079751, Nanos: 1}, {Seconds: -62135596800}, {Seconds: 253402300799, Nanos: 999999999},
		{Seconds: -1, Nanos: 500}, {Seconds: 253402300800}, {Nanos: -1}, nil,
	} {
		w := wireCall(&rolloutv1.LLMCall{StartedAt: ts})
		want := "null"
		if b, err := protojson.Marshal(ts); err == nil && ts != nil {
			want = string(b)
		}
		if string(w.StartedAt) != want {
			t.Errorf("%v: %s, want %s", ts, w.StartedAt, want)
		}
	}
}
