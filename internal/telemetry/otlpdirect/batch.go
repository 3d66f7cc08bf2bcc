package otlpdirect

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Exporter sends encoded OTLP trace export requests to a collector. It may
// be shared by providers, so Export may be called concurrently.
type Exporter interface {
	// Export sends one encoded ExportTraceServiceRequest. It may not keep
	// request after it returns.
	Export(ctx context.Context, request []byte) error
	Shutdown(ctx context.Context) error
}

// BatchConfig is the batch span processor's configuration (OTEL_BSP_*).
type BatchConfig struct {
	// Delay is the longest an ended span waits for export (5s).
	Delay time.Duration
	// ExportTimeout bounds one export, retries included (30s).
	ExportTimeout time.Duration
	// MaxQueue is the number of spans held for export; spans ending while
	// it is full are dropped (2048).
	MaxQueue int
	// MaxBatch is the number of spans per export (512, at most MaxQueue).
	MaxBatch int
}

// WithDefaults is c with the specification's defaults in its zero fields
// and MaxBatch at most MaxQueue, as the specification has it.
func (c BatchConfig) WithDefaults() BatchConfig {
	if c.Delay <= 0 {
		c.Delay = 5 * time.Second
	}
	if c.ExportTimeout <= 0 {
		c.ExportTimeout = 30 * time.Second
	}
	if c.MaxQueue <= 0 {
		c.MaxQueue = 2048
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = 512
	}
	c.MaxBatch = min(c.MaxBatch, c.MaxQueue)
	return c
}

// batcher collects encoded spans into chunks of at most MaxBatch spans,
// each the body of one export, and exports them from one goroutine, woken
// when a chunk is full or Delay has passed. Encoding happens in End, on the
// caller's goroutine, outside the batcher's lock.
type batcher struct {
	exp     Exporter
	cfg     BatchConfig
	onError func(error)

	resource  []byte // the Resource message
	schemaURL string // the resource's

	scratch sync.Pool // *[]byte: one span's encoding

	mu      sync.Mutex
	scopes  []scope
	full    []*chunk // chunks of MaxBatch spans, oldest first
	current *chunk   // being filled; nil when none
	queued  int      // spans in full and current
	dropped int
	free    []*chunk // exported chunks, for reuse
	stopped bool

	exportMu sync.Mutex // one export at a time, in order
	body     []byte     // the request being sent; exportMu guards it
	kick     chan struct{}
	stop     chan struct{}
	done     chan struct{}
}

// scope is an instrumentation scope: its InstrumentationScope message
// (nil: none) and schema URL.
type scope struct {
	msg       []byte
	schemaURL string
}

// chunk is the spans of one export, per scope: each a ScopeSpans.spans
// field, tag and length included.
type chunk struct {
	spans [][]byte // by scope index
	n     int
}

func newBatcher(exp Exporter, cfg BatchConfig, resource []byte, schemaURL string, onError func(error)) *batcher {
	b := &batcher{
		exp: exp, cfg: cfg, onError: onError,
		resource: resource, schemaURL: schemaURL,
		kick: make(chan struct{}, 1),
		stop: make(chan struct{}),
		done: make(chan struct{}),
	}
	go b.run()
	return b
}

// addScope registers a scope and returns its index.
func (b *batcher) addScope(msg []byte, schemaURL string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.scopes = append(b.scopes, scope{msg: msg, schemaURL: schemaURL})
	return len(b.scopes) - 1
}

// add encodes s (locked by the caller) and queues it for export.
func (b *batcher) add(s *span) {
	sp, _ := b.scratch.Get().(*[]byte)
	if sp == nil {
		sp = new([]byte)
	}
	enc := encoder{valueLimit: s.tracer.tp.limits.AttributeValueLengthLimit}
	body := enc.appendSpan((*sp)[:0], s)
	*sp = body
	defer b.scratch.Put(sp)

	b.mu.Lock()
	if b.stopped || b.queued >= b.cfg.MaxQueue {
		if !b.stopped {
			b.dropped++
		}
		b.mu.Unlock()
		return
	}
	c := b.current
	if c == nil {
		c = b.newChunk()
		b.current = c
	}
	for len(c.spans) < len(b.scopes) {
		c.spans = append(c.spans, nil)
	}
	i := s.tracer.scope
	c.spans[i] = appendLen(c.spans[i], fieldScopeSpansSpans, len(body))
	c.spans[i] = append(c.spans[i], body...)
	c.n++
	b.queued++
	kick := false
	if c.n == b.cfg.MaxBatch {
		b.full = append(b.full, c)
		b.current = nil
		kick = true
	}
	b.mu.Unlock()
	if kick {
		select {
		case b.kick <- struct{}{}:
		default:
		}
	}
}

// newChunk is an empty chunk, reusing an exported one's buffers.
func (b *batcher) newChunk() *chunk {
	if n := len(b.free); n > 0 {
		c := b.free[n-1]
		b.free = b.free[:n-1]
		return c
	}
	return &chunk{}
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
		if err := b.flush(context.Background()); err != nil && b.onError != nil {
			b.onError(err)
		}
		t.Reset(b.cfg.Delay)
	}
}

// flush exports every queued span, a chunk at a time.
func (b *batcher) flush(ctx context.Context) error {
	b.exportMu.Lock()
	defer b.exportMu.Unlock()
	b.mu.Lock()
	chunks := b.full
	b.full = nil
	if b.current != nil {
		chunks = append(chunks, b.current)
		b.current = nil
	}
	b.queued = 0
	dropped := b.dropped
	b.dropped = 0
	scopes := b.scopes
	b.mu.Unlock()

	var errs []error
	if dropped > 0 {
		errs = append(errs, fmt.Errorf("otlpdirect: span queue full (OTEL_BSP_MAX_QUEUE_SIZE=%d): %d spans dropped", b.cfg.MaxQueue, dropped))
	}
	for _, c := range chunks {
		b.body = b.request(b.body[:0], scopes, c)
		ectx, cancel := context.WithTimeout(ctx, b.cfg.ExportTimeout)
		if err := b.exp.Export(ectx, b.body); err != nil {
			errs = append(errs, fmt.Errorf("otlpdirect: export of %d spans: %w", c.n, err))
		}
		cancel()
	}
	if cap(b.body) > maxKeptBuffer {
		b.body = nil
	}

	b.mu.Lock()
	for _, c := range chunks {
		for i := range c.spans {
			if cap(c.spans[i]) > maxKeptBuffer {
				c.spans[i] = nil
			}
			c.spans[i] = c.spans[i][:0]
		}
		c.n = 0
		if len(b.free) < 2 {
			b.free = append(b.free, c)
		}
	}
	b.mu.Unlock()
	return errors.Join(errs...)
}

// maxKeptBuffer is the largest buffer kept for reuse between exports.
const maxKeptBuffer = 4 << 20

// request appends the ExportTraceServiceRequest of chunk c to dst: one
// ResourceSpans, with a ScopeSpans per scope that has spans.
func (b *batcher) request(dst []byte, scopes []scope, c *chunk) []byte {
	ssSize := func(i int) int {
		n := len(c.spans[i])
		if scopes[i].msg != nil {
			n += sizeLen(fieldScopeSpansScope, len(scopes[i].msg))
		}
		if u := scopes[i].schemaURL; u != "" {
			n += sizeLen(fieldScopeSpansSchemaURL, len(u))
		}
		return n
	}
	rs := 0
	if b.resource != nil {
		rs += sizeLen(fieldResourceSpansResource, len(b.resource))
	}
	for i := range c.spans {
		if len(c.spans[i]) > 0 {
			rs += sizeLen(fieldResourceSpansScopeSpans, ssSize(i))
		}
	}
	if b.schemaURL != "" {
		rs += sizeLen(fieldResourceSpansSchemaURL, len(b.schemaURL))
	}

	dst = appendLen(dst, fieldRequestResourceSpans, rs)
	if b.resource != nil {
		dst = appendLen(dst, fieldResourceSpansResource, len(b.resource))
		dst = append(dst, b.resource...)
	}
	for i := range c.spans {
		if len(c.spans[i]) == 0 {
			continue
		}
		dst = appendLen(dst, fieldResourceSpansScopeSpans, ssSize(i))
		if scopes[i].msg != nil {
			dst = appendLen(dst, fieldScopeSpansScope, len(scopes[i].msg))
			dst = append(dst, scopes[i].msg...)
		}
		dst = append(dst, c.spans[i]...)
		dst = appendString(dst, fieldScopeSpansSchemaURL, scopes[i].schemaURL)
	}
	return appendString(dst, fieldResourceSpansSchemaURL, b.schemaURL)
}

// shutdown exports what is queued and stops the goroutine; spans ended
// afterwards are dropped.
func (b *batcher) shutdown(ctx context.Context) error {
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
	return b.flush(ctx)
}
