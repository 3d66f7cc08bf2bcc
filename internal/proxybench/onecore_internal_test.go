package proxybench

import (
	"bytes"
	"maps"
	"net/http"
	"net/http/httptest"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// TestSpanSink: the sink counts the spans of an export per process and
// counts an export it cannot read as bad.
func TestSpanSink(t *testing.T) {
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
	sink := &spanSink{byPID: map[int64]int64{}}
	for _, body := range [][]byte{b, b[:len(b)-3], nil} {
		w := httptest.NewRecorder()
		sink.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/traces", bytes.NewReader(body)))
	}
	got, bad := sink.counts()
	if want := map[int64]int64{4242: 5, -1: 1}; !maps.Equal(got, want) || bad != 1 {
		t.Errorf("the sink counted %v spans and %d bad exports, want %v and 1 (the truncated one)", got, bad, want)
	}
}
