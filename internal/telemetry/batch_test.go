package telemetry

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// countingExporter remembers the batches it was given.
type countingExporter struct {
	mu       sync.Mutex
	batches  []int
	shutdown bool
}

func (e *countingExporter) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.batches = append(e.batches, len(spans))
	return nil
}

func (e *countingExporter) Shutdown(context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.shutdown = true
	return nil
}

func (e *countingExporter) state() ([]int, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]int(nil), e.batches...), e.shutdown
}

func span(sampled bool) sdktrace.ReadOnlySpan {
	flags := trace.TraceFlags(0)
	if sampled {
		flags = trace.FlagsSampled
	}
	return tracetest.SpanStub{SpanContext: trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: flags,
	})}.Snapshot()
}

func TestBatcher(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	exp := &countingExporter{}
	b := newBatcher(exp, otlpdirect.BatchConfig{Delay: time.Hour, ExportTimeout: time.Second, MaxQueue: 3, MaxBatch: 2}, func(error) {})

	b.OnEnd(span(false)) // not sampled: not exported
	for range 5 {
		b.OnEnd(span(true))
	}
	// The queue holds 3: the first batch of 2 may already be on its way, the
	// rest stays until a flush; nothing past the queue's size is kept.
	err := b.ForceFlush(ctx)
	batches, _ := exp.state()
	total := 0
	for _, n := range batches {
		if n > 2 {
			t.Errorf("a batch of %d spans, want at most OTEL_BSP_MAX_EXPORT_BATCH_SIZE=2", n)
		}
		total += n
	}
	if total < 3 || total > 5 {
		t.Errorf("exported %d spans (batches %v), want the 3 queued plus at most the 2 sent early", total, batches)
	}
	if total < 5 && (err == nil || !strings.Contains(err.Error(), "dropped")) {
		t.Errorf("ForceFlush = %v after %d of 5 spans were exported, want the drops reported", err, total)
	}

	b.OnEnd(span(true))
	if err := b.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	batches, shut := exp.state()
	if !shut {
		t.Error("Shutdown did not shut the exporter down")
	}
	after := 0
	for _, n := range batches {
		after += n
	}
	if after != total+1 {
		t.Errorf("Shutdown exported %d more spans, want the 1 queued", after-total)
	}
	select {
	case <-b.done:
	default:
		t.Error("the export goroutine is still running after Shutdown")
	}
	b.OnEnd(span(true))
	if err := b.ForceFlush(ctx); err != nil {
		t.Errorf("ForceFlush after Shutdown: %v", err)
	}
	if batches, _ := exp.state(); sum(batches) != after {
		t.Errorf("a span ended after Shutdown was exported")
	}
	if err := b.Shutdown(ctx); err != nil {
		t.Errorf("second Shutdown: %v", err)
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}
