package otlpdirect_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

var (
	t0           = time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)
	remoteParent = trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
		Remote:     true,
	})
)

type customError struct{}

func (customError) Error() string { return "custom failure" }

// play records the same spans on any tracer: every kind of attribute
// value, duplicates, limits overrun, events, errors, links, statuses,
// names, kinds and explicit times.
func play(tr trace.Tracer) {
	ts, _ := trace.ParseTraceState("vendor=value,other=1")
	parentCtx := trace.ContextWithRemoteSpanContext(context.Background(), remoteParent.WithTraceState(ts))

	ctx, root := tr.Start(parentCtx, "chat policy-model", trace.WithSpanKind(trace.SpanKindClient), trace.WithTimestamp(t0),
		trace.WithAttributes(attribute.String("at.start", "yes")))
	root.SetAttributes(
		attribute.String("gen_ai.operation.name", "chat"),
		attribute.Int("gen_ai.usage.input_tokens", 1234),
		attribute.Int64("negative", -42),
		attribute.Float64("gen_ai.request.temperature", 0.7),
		attribute.Bool("flag", true),
		attribute.Bool("off", false),
		attribute.StringSlice("gen_ai.response.finish_reasons", []string{"stop", "length"}),
		attribute.IntSlice("ints", []int{1, -2, 3}),
		attribute.Float64Slice("floats", []float64{0.5, -1.25}),
		attribute.BoolSlice("bools", []bool{true, false}),
		attribute.String("empty", ""),
		attribute.String("unicode", "héllo wörld ✓ — a long value that the limit cuts"),
		// Lengths of one, two and three bytes, for the messages around them.
		attribute.String("medium", strings.Repeat("m", 200)),
		attribute.String("long", strings.Repeat("l", 20000)),

		attribute.String("gen_ai.operation.name", "chat-again"), // a duplicate: the last value wins
	)
	root.AddEvent("retry", trace.WithTimestamp(t0.Add(time.Millisecond)), trace.WithAttributes(
		attribute.Int("osmo.attempt", 1), attribute.Float64("osmo.retry.delay_ms", 250), attribute.Int("osmo.attempt", 2)))
	root.RecordError(customError{}, trace.WithTimestamp(t0.Add(2*time.Millisecond)))
	root.RecordError(errors.New("plain"), trace.WithTimestamp(t0.Add(3*time.Millisecond)))
	root.SetStatus(codes.Error, "upstream answered 503")

	_, child := tr.Start(ctx, "execute_tool calculator", trace.WithTimestamp(t0.Add(5*time.Millisecond)),
		trace.WithLinks(trace.Link{SpanContext: remoteParent, Attributes: []attribute.KeyValue{attribute.String("link.kind", "follows")}}))
	child.SetName("execute_tool add")
	child.AddLink(trace.Link{SpanContext: remoteParent.WithTraceState(ts)})
	child.SetStatus(codes.Ok, "ignored for ok")
	child.SetStatus(codes.Error, "too late: ok is final")
	for i := range 6 { // more than the limit of 4
		child.SetAttributes(attribute.Int(fmt.Sprintf("k%d", i), i))
	}
	child.SetAttributes(attribute.Int("k0", 100)) // an update to a kept key, over the limit
	for i := range 6 {
		child.AddEvent(fmt.Sprintf("event %d", i), trace.WithTimestamp(t0.Add(time.Duration(6+i)*time.Millisecond)))
	}
	child.End(trace.WithTimestamp(t0.Add(20 * time.Millisecond)))

	_, fresh := tr.Start(ctx, "grade", trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(t0))
	fresh.End(trace.WithTimestamp(t0.Add(time.Second)))

	root.End(trace.WithTimestamp(t0.Add(30 * time.Millisecond)))
	root.SetAttributes(attribute.String("after.end", "dropped"))
	root.End() // a second End is ignored
}

var limits = sdktrace.SpanLimits{
	AttributeValueLengthLimit:   20,
	AttributeCountLimit:         16,
	EventCountLimit:             4,
	LinkCountLimit:              1,
	AttributePerEventCountLimit: 2,
	AttributePerLinkCountLimit:  4,
}

func testResource(t *testing.T) *resource.Resource {
	t.Helper()
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(attribute.String("service.name", "osmo-llmproxy"), attribute.Int("process.pid", 4242)))
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// TestSameAsSDK records the same spans through the SDK and its OTLP/HTTP
// exporter and through this package, and compares what the collector
// receives, ids aside (they are random).
func TestSameAsSDK(t *testing.T) {
	ctx := context.Background()
	res := testResource(t)
	// The child has more attributes than this limit allows.
	childLimits := limits
	childLimits.AttributeCountLimit = 4

	for _, tc := range []struct {
		name   string
		limits sdktrace.SpanLimits
	}{{"limits", limits}, {"child limits", childLimits}, {"no limits", sdktrace.SpanLimits{
		AttributeValueLengthLimit: -1, AttributeCountLimit: -1, EventCountLimit: -1, LinkCountLimit: -1,
		AttributePerEventCountLimit: -1, AttributePerLinkCountLimit: -1}}} {
		t.Run(tc.name, func(t *testing.T) {
			sdkSink, directSink := newHTTPSink(t), newHTTPSink(t)
			exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(sdkSink.url+"/v1/traces"))
			if err != nil {
				t.Fatal(err)
			}
			sdkTP := sdktrace.NewTracerProvider(sdktrace.WithResource(res), sdktrace.WithRawSpanLimits(tc.limits),
				sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample())), sdktrace.WithBatcher(exp))
			play(sdkTP.Tracer("github.com/osmo-rl/osmo/pkg/llmproxy", trace.WithInstrumentationVersion("1.2.3"),
				trace.WithInstrumentationAttributes(attribute.String("scope.attr", "x"))))
			if err := sdkTP.Shutdown(ctx); err != nil {
				t.Fatal(err)
			}

			directExp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: directSink.url + "/v1/traces"})
			tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: directExp, Resource: res, Limits: &tc.limits})
			play(tp.Tracer("github.com/osmo-rl/osmo/pkg/llmproxy", trace.WithInstrumentationVersion("1.2.3"),
				trace.WithInstrumentationAttributes(attribute.String("scope.attr", "x"))))
			if err := tp.Shutdown(ctx); err != nil {
				t.Fatal(err)
			}

			want, got := sdkSink.only(t), directSink.only(t)
			normalizeIDs(want)
			normalizeIDs(got)
			// The SDK's exporter leaves a link's trace state out; OTLP has
			// a field for it, and this package fills it.
			sawLinkState := false
			for _, rs := range got.GetResourceSpans() {
				for _, ss := range rs.GetScopeSpans() {
					for _, sp := range ss.GetSpans() {
						for _, l := range sp.GetLinks() {
							sawLinkState = sawLinkState || l.GetTraceState() == "vendor=value,other=1"
							l.TraceState = ""
						}
					}
				}
			}
			if !sawLinkState {
				t.Error("no link carries the trace state it was added with")
			}
			if !proto.Equal(want, got) {
				t.Errorf("the collector received different spans\nSDK:\n%s\notlpdirect:\n%s",
					prototext.Format(want), prototext.Format(got))
			}
			if n := countSpans(got); n != 3 {
				t.Errorf("%d spans exported, want 3", n)
			}
		})
	}
}

func countSpans(req *coltracepb.ExportTraceServiceRequest) int {
	n := 0
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			n += len(ss.GetSpans())
		}
	}
	return n
}

// normalizeIDs replaces the ids the spans were given (random) by their
// order of appearance, keeping the remote parent's, so that two runs
// compare.
func normalizeIDs(req *coltracepb.ExportTraceServiceRequest) {
	spanIDs, traceIDs := map[string][]byte{}, map[string][]byte{}
	rename := func(m map[string][]byte, id []byte, size int, keep []byte) []byte {
		if len(id) == 0 || string(id) == string(keep) {
			return id
		}
		if v, ok := m[string(id)]; ok {
			return v
		}
		v := make([]byte, size)
		v[size-1] = byte(len(m) + 1)
		m[string(id)] = v
		return v
	}
	tid, sid := remoteParent.TraceID(), remoteParent.SpanID()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				sp.TraceId = rename(traceIDs, sp.TraceId, 16, tid[:])
				sp.SpanId = rename(spanIDs, sp.SpanId, 8, sid[:])
			}
		}
	}
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				sp.ParentSpanId = rename(spanIDs, sp.ParentSpanId, 8, sid[:])
			}
		}
	}
}

// TestInvalidUTF8 sends a string that is not UTF-8 with its bad bytes
// replaced: the SDK's exporter fails the whole batch over one (protobuf
// strings must be UTF-8), and so would a collector.
func TestInvalidUTF8(t *testing.T) {
	ctx := context.Background()
	sink := newHTTPSink(t)
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.url + "/v1/traces"})})
	_, s := tp.Tracer("test").Start(ctx, "bad\xfename", trace.WithAttributes(attribute.String("k\xff", "ok\xffthen")))
	s.End()
	if err := tp.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	sp := sink.only(t).GetResourceSpans()[0].GetScopeSpans()[0].GetSpans()[0]
	kv := sp.GetAttributes()[0]
	if sp.GetName() != "bad\uFFFDname" || kv.GetKey() != "k\uFFFD" || kv.GetValue().GetStringValue() != "ok\uFFFDthen" {
		t.Errorf("name %q, attribute %q=%q: want the invalid bytes replaced by U+FFFD", sp.GetName(), kv.GetKey(), kv.GetValue().GetStringValue())
	}
}
