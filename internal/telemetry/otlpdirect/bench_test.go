package otlpdirect_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// chatAttrs are the attributes of an LLM proxy chat span.
var chatAttrs = []attribute.KeyValue{
	attribute.String("gen_ai.operation.name", "chat"),
	attribute.String("gen_ai.provider.name", "openai"),
	attribute.String("gen_ai.request.model", "policy-v1"),
	attribute.String("osmo.llm.requested_model", "openai/osmosis-rollout"),
	attribute.Float64("gen_ai.request.temperature", 1),
	attribute.Int("gen_ai.request.max_tokens", 16),
	attribute.String("gen_ai.response.id", "chatcmpl-8f2d1c"),
	attribute.StringSlice("gen_ai.response.finish_reasons", []string{"stop"}),
	attribute.Int("gen_ai.usage.input_tokens", 24),
	attribute.Int("gen_ai.usage.output_tokens", 8),
}

// BenchmarkChatSpan starts and ends one chat span per operation, with the
// proxy's attributes, in a trace, exported over OTLP/HTTP to a loopback
// collector that drops the requests: through the OpenTelemetry SDK and its
// OTLP exporter, and through this package. Every 512 spans the loop
// flushes, so that all the export work is inside the timing and no span is
// dropped for a full queue. Compare ns/op, B/op and allocs/op of the two.
func BenchmarkChatSpan(b *testing.B) {
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	defer sink.Close()
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), remoteParent)
	for _, pipeline := range []string{"sdk", "direct"} {
		b.Run(pipeline, func(b *testing.B) {
			var tp interface {
				trace.TracerProvider
				ForceFlush(context.Context) error
				Shutdown(context.Context) error
			}
			if pipeline == "sdk" {
				exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(sink.URL+"/v1/traces"))
				if err != nil {
					b.Fatal(err)
				}
				tp = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
			} else {
				exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.URL + "/v1/traces"})
				tp = otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Sampler: sdktrace.AlwaysSample()})
			}
			tr := tp.Tracer("github.com/osmo-rl/osmo/pkg/llmproxy")
			opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindClient)}
			b.ReportAllocs()
			n := 0
			for b.Loop() {
				_, s := tr.Start(ctx, "chat policy-v1", opts...)
				s.SetAttributes(chatAttrs...)
				s.End()
				if n++; n%512 == 0 {
					if err := tp.ForceFlush(ctx); err != nil {
						b.Fatal(err)
					}
				}
			}
			if err := tp.Shutdown(ctx); err != nil {
				b.Fatal(err)
			}
		})
	}
}
