package proxybench

import (
	"maps"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// TestCountSpans checks the sink's protobuf walk against the real
// encoding of an export.
func TestCountSpans(t *testing.T) {
	str := func(k, v string) *commonpb.KeyValue {
		return &commonpb.KeyValue{Key: k, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: v}}}
	}
	spans := func(n int) []*tracepb.Span {
		s := make([]*tracepb.Span, n)
		for i := range s {
			s[i] = &tracepb.Span{Name: "chat bench-policy", Attributes: []*commonpb.KeyValue{str("gen_ai.system", "openai")}}
		}
		return s
	}
	req := &coltracepb.ExportTraceServiceRequest{ResourceSpans: []*tracepb.ResourceSpans{
		{
			Resource: &resourcepb.Resource{Attributes: []*commonpb.KeyValue{
				str("service.name", "osmo-llmproxy-bench"),
				{Key: "process.pid", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_IntValue{IntValue: 4242}}},
			}},
			ScopeSpans: []*tracepb.ScopeSpans{{Spans: spans(2)}, {Spans: spans(3)}},
		},
		{ScopeSpans: []*tracepb.ScopeSpans{{Spans: spans(1)}}},
	}}
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	got := map[int64]int64{}
	if err := countSpans(b, got); err != nil {
		t.Fatalf("countSpans: %v", err)
	}
	if want := map[int64]int64{4242: 5, -1: 1}; !maps.Equal(got, want) {
		t.Errorf("countSpans = %v, want %v", got, want)
	}
	if err := countSpans(b[:len(b)-3], map[int64]int64{}); err == nil {
		t.Error("countSpans of a truncated export succeeded, want an error")
	}
	if err := countSpans(nil, map[int64]int64{}); err != nil {
		t.Errorf("countSpans of an empty export: %v", err)
	}
}
