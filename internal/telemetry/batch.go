package telemetry

import (
	"context"
	"errors"
	"sync"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// batcher is a batching span processor. The SDK's own hands every ended
// span to its export goroutine over a channel, waking that goroutine once
// per span. Here ending a span is an append under a mutex, and the
// goroutine wakes once per batch or per schedule delay: with the same
// allocations, the SDK's costs 20 to 30% more CPU per span in three of
// the four setups of BenchmarkBatchSpanProcessor (2% more in the fourth,
// parallel on two CPUs); docs/performance.md has the figures and the
// command.
type batcher struct {
	exp     sdktrace.SpanExporter
	cfg     otlpdirect.BatchConfig // with defaults
	onError func(error)            // failed exports and dropped spans

	mu      sync.Mutex
	queue   []sdktrace.ReadOnlySpan
	dropped int
	stopped bool

	exportMu sync.Mutex // one export at a time, in order
	kick     chan struct{}
	stop     chan struct{}
	done     chan struct{}
}

func newBatcher(exp sdktrace.SpanExporter, cfg otlpdirect.BatchConfig, onError func(error)) *batcher {
	cfg = cfg.WithDefaults()
	b := &batcher{
		exp:     exp,
		cfg:     cfg,
		onError: onError,
		queue:   make([]sdktrace.ReadOnlySpan, 0, cfg.MaxBatch),
		kick:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	go b.run()
	return b
}

func (b *batcher) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

func (b *batcher) OnEnd(s sdktrace.ReadOnlySpan) {
	if !s.SpanContext().IsSampled() {
		return
	}
	b.mu.Lock()
	if b.stopped {
		b.mu.Unlock()
		return
	}
	if len(b.queue) >= b.cfg.MaxQueue {
		b.dropped++
		b.mu.Unlock()
		return
	}
	b.queue = append(b.queue, s)
	full := len(b.queue) == b.cfg.MaxBatch
	b.mu.Unlock()
	if full {
		select {
		case b.kick <- struct{}{}:
		default:
		}
	}
}

func (b *batcher) run() {
	defer close(b.done)
	t := time.NewTimer(b.cfg.Delay)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-b.kick:
		case <-t.C:
		}
		if err := b.export(context.Background()); err != nil {
			b.onError(err)
		}
		t.Reset(b.cfg.Delay)
	}
}

// export sends everything queued, a batch at a time.
func (b *batcher) export(ctx context.Context) error {
	b.exportMu.Lock()
	defer b.exportMu.Unlock()
	b.mu.Lock()
	spans := b.queue
	b.queue = make([]sdktrace.ReadOnlySpan, 0, b.cfg.MaxBatch)
	dropped := b.dropped
	b.dropped = 0
	b.mu.Unlock()
	var errs []error
	if dropped > 0 {
		errs = append(errs, errors.New("telemetry: span queue full (OTEL_BSP_MAX_QUEUE_SIZE): spans dropped"))
	}
	for len(spans) > 0 {
		n := min(len(spans), b.cfg.MaxBatch)
		ectx, cancel := context.WithTimeout(ctx, b.cfg.ExportTimeout)
		err := b.exp.ExportSpans(ectx, spans[:n])
		cancel()
		if err != nil {
			errs = append(errs, err)
		}
		spans = spans[n:]
	}
	return errors.Join(errs...)
}

func (b *batcher) ForceFlush(ctx context.Context) error { return b.export(ctx) }

// Shutdown exports what is queued and shuts the exporter down; spans ended
// afterwards are dropped.
func (b *batcher) Shutdown(ctx context.Context) error {
	b.mu.Lock()
	if b.stopped {
		b.mu.Unlock()
		return nil
	}
	b.stopped = true
	b.mu.Unlock()
	close(b.stop)
	select {
	case <-b.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	return errors.Join(b.export(ctx), b.exp.Shutdown(ctx))
}
