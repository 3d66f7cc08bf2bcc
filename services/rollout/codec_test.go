package rollout

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// codecRecord is a finished record with every kind of field set: Structs
// nested in lists, nulls, optional zeros, repeated scalars, timestamps.
func codecRecord(t *testing.T) *rolloutv1.Rollout {
	t.Helper()
	msg := func(v map[string]any) *structpb.Struct {
		s, err := structpb.NewStruct(v)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	user := msg(map[string]any{"role": "user", "content": "What is 6 times 7?"})
	assistant := msg(map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{
		map[string]any{"id": "call_1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":6,"b":7}`}},
	}})
	now := time.Unix(1_800_000_000, 123_456_789)
	return &rolloutv1.Rollout{
		RolloutId: "r-1", State: rolloutv1.State_STATE_SUCCEEDED, Workflow: "multiply",
		Reward: proto.Float64(0), FinishReason: "stop", ErrorCategory: "", Wire: "g2", Sequence: 42,
		Metrics:   &rolloutv1.RolloutMetrics{TotalLatencyMs: 12.5, NumLlmCalls: 2, PromptTokens: 30},
		Metadata:  msg(map[string]any{"split": "train", "n": 3.0, "ok": true, "tags": []any{"a", 1.5, nil}}),
		CreatedAt: timestamppb.New(now), StartedAt: timestamppb.New(now.Add(time.Millisecond)),
		FinishedAt: timestamppb.New(now.Add(time.Second)),
		Samples: []*rolloutv1.RolloutSample{{
			RolloutId: "r-1", Id: "s-1", Messages: []*structpb.Struct{user, assistant},
			Label: proto.String("42"), Reward: proto.Float64(1), AgentReward: proto.Float64(-0.5),
			Metadata: msg(map[string]any{}), ExtraFields: msg(map[string]any{"k": map[string]any{"deep": []any{}}}),
			LlmCalls: []*rolloutv1.LLMCall{{
				Id: "c-1", RequestedModel: "openai/osmosis-rollout", Model: "policy",
				RequestMessages: []*structpb.Struct{user}, ResponseMessage: assistant,
				Usage:          &rolloutv1.Usage{PromptTokens: 15, CompletionTokens: 5, TotalTokens: 20},
				PromptTokenIds: []int32{1, 2, 3}, CompletionTokenIds: []int32{4, -5},
				Logprobs: []float64{-0.25, 0}, StatusCode: 200, Attempts: 1, StartedAt: timestamppb.New(now),
				Api: "chat.completions",
			}},
		}},
	}
}

// What the generated code writes, protobuf-go reads as the same message,
// and the other way round: records stored by one build are read by another
// (a rolling update).
func TestCodecIsProtobufWireFormat(t *testing.T) {
	rec := codecRecord(t)
	fast, err := marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var viaProto rolloutv1.Rollout
	if err := proto.Unmarshal(fast, &viaProto); err != nil {
		t.Fatalf("proto.Unmarshal of the generated encoding: %v", err)
	}
	if !proto.Equal(&viaProto, rec) {
		t.Errorf("proto.Unmarshal of the generated encoding:\n got %v\nwant %v", &viaProto, rec)
	}
	if want := proto.Size(rec); len(fast) != want {
		t.Errorf("generated encoding is %d bytes, protobuf-go's %d", len(fast), want)
	}

	slow, err := proto.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	// unmarshal replaces what the message held.
	got := &rolloutv1.Rollout{RolloutId: "stale", ErrorMessage: "stale", Samples: []*rolloutv1.RolloutSample{{Id: "stale"}}}
	if err := unmarshal(slow, got); err != nil {
		t.Fatalf("unmarshal of protobuf-go's encoding: %v", err)
	}
	if !proto.Equal(got, rec) {
		t.Errorf("unmarshal of protobuf-go's encoding:\n got %v\nwant %v", got, rec)
	}
	if err := unmarshal([]byte{0x0a, 0x05, 'a'}, got); err == nil {
		t.Error("unmarshal of a truncated record: no error")
	}
}

// A record whose error text is not UTF-8 (a workflow's error, as it was
// written) is stored and read back, where protobuf-go refused to encode
// it and the record was lost.
func TestCodecKeepsARecordWithInvalidUTF8(t *testing.T) {
	rec := &rolloutv1.Rollout{RolloutId: "r-1", ErrorMessage: "agent: \xff\xfe"}
	if _, err := proto.Marshal(rec); err == nil {
		t.Fatal("protobuf-go encoded invalid UTF-8; this test's premise is gone")
	}
	b, err := marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var got rolloutv1.Rollout
	if err := unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.GetErrorMessage() != rec.GetErrorMessage() {
		t.Errorf("error message %q, want %q", got.GetErrorMessage(), rec.GetErrorMessage())
	}
}

// BenchmarkRecordEncoding: the finished record of a two-call rollout,
// through protobuf-go's reflection and through the generated code.
func BenchmarkRecordEncoding(b *testing.B) {
	t := &testing.T{}
	rec := codecRecord(t)
	b.Run("proto.Marshal", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := proto.Marshal(rec); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("generated", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := marshal(rec); err != nil {
				b.Fatal(err)
			}
		}
	})
}
