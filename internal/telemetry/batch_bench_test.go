//go:build unix

package telemetry

import (
	"context"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// dropExporter counts the spans it is given and drops them.
type dropExporter struct{ spans atomic.Int64 }

func (e *dropExporter) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.spans.Add(int64(len(spans)))
	return nil
}

func (*dropExporter) Shutdown(context.Context) error { return nil }

// processCPU is the CPU time (user and system) this process has used, all
// goroutines included: the export goroutine's work does not show in a
// benchmark's wall time when it runs on another core.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkBatchSpanProcessor compares osmo's batcher with the SDK's
// BatchSpanProcessor behind the same provider (every span sampled, the
// baggage processor first, as Setup builds it) and the same exporter,
// which drops the batches: each op starts and ends one span with the
// attributes a rollout stage's span carries. Run both in one invocation:
//
//	go test -run '^$' -bench BenchmarkBatchSpanProcessor -benchmem -count 6 -cpu 1,2 ./internal/telemetry/
//
// cpu-ns/op is the process's CPU time per span, the export goroutine's
// included; dropped/op the share of spans not exported (0 expected).
func BenchmarkBatchSpanProcessor(b *testing.B) {
	processors := []struct {
		name string
		new  func(sdktrace.SpanExporter, otlpdirect.BatchConfig) sdktrace.SpanProcessor
	}{
		{"osmo", func(e sdktrace.SpanExporter, c otlpdirect.BatchConfig) sdktrace.SpanProcessor {
			return newBatcher(e, c, func(error) {})
		}},
		{"sdk", func(e sdktrace.SpanExporter, c otlpdirect.BatchConfig) sdktrace.SpanProcessor {
			return sdktrace.NewBatchSpanProcessor(e, sdktrace.WithBatchTimeout(c.Delay), sdktrace.WithExportTimeout(c.ExportTimeout),
				sdktrace.WithMaxQueueSize(c.MaxQueue), sdktrace.WithMaxExportBatchSize(c.MaxBatch))
		}},
	}
	attrs := []attribute.KeyValue{
		attribute.String("osmo.rollout.id", "r-0123456789"),
		attribute.String("osmo.sample.id", "s0"),
		attribute.Int("osmo.attempt", 1),
		attribute.String("url.full", "http://trainer:8080/v1/rollout/completed"),
	}
	for _, mode := range []string{"serial", "parallel"} {
		for _, p := range processors {
			b.Run(mode+"/"+p.name, func(b *testing.B) {
				exp := &dropExporter{}
				// Default batching, with a queue that holds every span of
				// the run: a loop ending spans back to back outruns the
				// export goroutine (on one core it may not run at all),
				// and dropping spans would flatter whichever drops more.
				cfg := otlpdirect.BatchConfig{MaxQueue: b.N + 2048}.WithDefaults()
				tp := sdktrace.NewTracerProvider(
					sdktrace.WithSampler(sdktrace.AlwaysSample()),
					sdktrace.WithSpanProcessor(BaggageAttributes()),
					sdktrace.WithSpanProcessor(p.new(exp, cfg)),
				)
				defer func() { _ = tp.Shutdown(context.Background()) }()
				tracer := tp.Tracer("bench")
				ctx := context.Background()
				one := func() {
					_, s := tracer.Start(ctx, "deliver_completion", trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
					s.End()
				}
				for range 1000 { // warm the pools and the export goroutine
					one()
				}
				if err := tp.ForceFlush(ctx); err != nil {
					b.Fatal(err)
				}
				before := exp.spans.Load()
				b.ReportAllocs()
				cpu0 := processCPU(b)
				b.ResetTimer()
				if mode == "serial" {
					for range b.N {
						one()
					}
				} else {
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							one()
						}
					})
				}
				// What is queued is exported inside the timing: the
				// export goroutine's work is part of the cost.
				if err := tp.ForceFlush(ctx); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				b.ReportMetric(float64(processCPU(b)-cpu0)/float64(b.N), "cpu-ns/op")
				b.ReportMetric(1-float64(exp.spans.Load()-before)/float64(b.N), "dropped/op")
			})
		}
	}
}
