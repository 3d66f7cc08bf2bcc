// Package otlpdirect is an OpenTelemetry TracerProvider for hot paths: each
// span is written in the OTLP protobuf wire format as it ends, into batches
// of bytes that go to the collector over OTLP/HTTP or OTLP/gRPC as they are.
//
// The OpenTelemetry SDK keeps an ended span as an object graph until its
// exporter turns the batch into protobuf messages and marshals them; on the
// LLM proxy, which serves tens of thousands of calls a second on one core,
// that work and its garbage cost about a fifth of what the proxy serves on
// a core (osmo bench). Here a span is a small struct while it is open
// and a few hundred bytes once it ends, and an export is one write of bytes
// already encoded: the same spans, on the same wire, for a fraction of the
// CPU.
//
// What it shares with the SDK it takes from the SDK: samplers
// (sdktrace.Sampler, so OTEL_TRACES_SAMPLER means the same), span limits
// (sdktrace.SpanLimits) and resources. What a span records, and how it is
// encoded, follows the SDK and its OTLP exporter: the tests decode both and
// compare. It does not run span processors; a provider has one batch
// pipeline (Config.Batch) and Config.StartAttributes for what a processor's
// OnStart would add. A panic unwinding through a deferred End is not
// recorded on the span.
package otlpdirect

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
)

// Config configures a TracerProvider.
type Config struct {
	// Exporter sends the encoded requests. It is shared: Shutdown of the
	// provider flushes its spans but leaves the exporter running.
	Exporter Exporter
	// Resource describes the process (nil: none).
	Resource *resource.Resource
	// Sampler decides which spans are recorded and sampled; nil is
	// parent-based always-on, the SDK's default.
	Sampler sdktrace.Sampler
	// Limits bound what a span holds; the zero value means
	// sdktrace.NewSpanLimits() (the OTEL_SPAN_* variables, or their
	// defaults).
	Limits *sdktrace.SpanLimits
	// Batch says how spans are batched; zero fields take the
	// specification's defaults.
	Batch BatchConfig
	// StartAttributes, when set, returns attributes to add to a span that
	// starts under parent, as a span processor's OnStart would.
	StartAttributes func(parent context.Context) []attribute.KeyValue
	// OnError is told about failed exports and dropped spans (nil: they
	// are dropped silently).
	OnError func(error)
}

// TracerProvider is a trace.TracerProvider whose spans are encoded as they
// end and exported in batches. Its methods are safe for concurrent use.
type TracerProvider struct {
	embedded.TracerProvider

	sampler  sdktrace.Sampler
	limits   sdktrace.SpanLimits
	startFn  func(context.Context) []attribute.KeyValue
	batch    *batcher
	attrPool sync.Pool // *[]attribute.KeyValue
	// stopped is set by Shutdown; spans started afterwards do not record.
	stopped atomic.Bool

	mu      sync.Mutex
	tracers map[tracerKey]*tracer
}

type tracerKey struct{ name, version, schemaURL string }

// NewTracerProvider starts a provider's batch pipeline; Shutdown stops it.
func NewTracerProvider(cfg Config) *TracerProvider {
	tp := &TracerProvider{
		sampler: cfg.Sampler,
		startFn: cfg.StartAttributes,
		tracers: map[tracerKey]*tracer{},
	}
	if tp.sampler == nil {
		tp.sampler = sdktrace.ParentBased(sdktrace.AlwaysSample())
	}
	if cfg.Limits != nil {
		tp.limits = *cfg.Limits
	} else {
		tp.limits = sdktrace.NewSpanLimits()
	}
	schemaURL := ""
	if cfg.Resource != nil {
		schemaURL = cfg.Resource.SchemaURL()
	}
	tp.batch = newBatcher(cfg.Exporter, cfg.Batch.WithDefaults(), encodeResource(cfg.Resource), schemaURL, cfg.OnError)
	return tp
}

// Tracer returns the tracer of an instrumentation scope; the same name,
// version and schema URL return the same tracer.
func (tp *TracerProvider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	c := trace.NewTracerConfig(opts...)
	key := tracerKey{name: name, version: c.InstrumentationVersion(), schemaURL: c.SchemaURL()}
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if t, ok := tp.tracers[key]; ok {
		return t
	}
	set := c.InstrumentationAttributes()
	scope := encodeScope(name, key.version, set.ToSlice())
	t := &tracer{tp: tp, scope: tp.batch.addScope(scope, key.schemaURL)}
	tp.tracers[key] = t
	return t
}

// ForceFlush exports every span ended so far.
func (tp *TracerProvider) ForceFlush(ctx context.Context) error { return tp.batch.flush(ctx) }

// Shutdown exports what is pending and stops the pipeline; spans that end
// afterwards are dropped. It does not shut the exporter down.
func (tp *TracerProvider) Shutdown(ctx context.Context) error {
	tp.stopped.Store(true)
	return tp.batch.shutdown(ctx)
}

type tracer struct {
	embedded.Tracer
	tp    *TracerProvider
	scope int // the scope's index in the batcher
}

// Start starts a span as the SDK's tracer does: a child of the span in
// ctx (unless trace.WithNewRoot), sampled as the sampler decides.
func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if ctx == nil {
		ctx = context.Background()
	}
	cfg := trace.NewSpanStartConfig(opts...)
	var parent trace.SpanContext
	if cfg.NewRoot() {
		ctx = trace.ContextWithSpanContext(ctx, parent)
	} else {
		parent = trace.SpanContextFromContext(ctx)
	}
	tp := t.tp
	if tp.stopped.Load() {
		// As the SDK's after shutdown: the parent's context, not recorded.
		ctx = trace.ContextWithSpanContext(ctx, parent)
		return ctx, trace.SpanFromContext(ctx)
	}
	var tid trace.TraceID
	if parent.IsValid() {
		tid = parent.TraceID()
	} else {
		tid = newTraceID()
	}
	kind := trace.ValidateSpanKind(cfg.SpanKind())
	res := tp.sampler.ShouldSample(sdktrace.SamplingParameters{
		ParentContext: ctx, TraceID: tid, Name: name, Kind: kind,
		Attributes: cfg.Attributes(), Links: cfg.Links(),
	})
	scc := trace.SpanContextConfig{TraceID: tid, SpanID: newSpanID(), TraceState: res.Tracestate}
	if res.Decision == sdktrace.RecordAndSample {
		scc.TraceFlags = parent.TraceFlags() | trace.FlagsSampled
	} else {
		scc.TraceFlags = parent.TraceFlags() &^ trace.FlagsSampled
	}
	sc := trace.NewSpanContext(scc)
	if res.Decision == sdktrace.Drop {
		ctx = trace.ContextWithSpanContext(ctx, sc)
		return ctx, trace.SpanFromContext(ctx)
	}

	s := &span{tracer: t, sc: sc, parent: parent, name: name, kind: kind, start: cfg.Timestamp()}
	if s.start.IsZero() {
		s.start = time.Now()
	}
	s.attrBuf = tp.getAttrs()
	s.attrs = *s.attrBuf
	s.setAttributes(res.Attributes)
	s.setAttributes(cfg.Attributes())
	for _, l := range cfg.Links() {
		s.addLink(l)
	}
	if tp.startFn != nil {
		if attrs := tp.startFn(ctx); len(attrs) > 0 {
			s.setAttributes(attrs)
		}
	}
	return trace.ContextWithSpan(ctx, s), s
}

// Attribute slices are reused: a span's goes back once it is encoded.
func (tp *TracerProvider) getAttrs() *[]attribute.KeyValue {
	if p, ok := tp.attrPool.Get().(*[]attribute.KeyValue); ok {
		return p
	}
	a := make([]attribute.KeyValue, 0, 32)
	return &a
}

func (tp *TracerProvider) putAttrs(p *[]attribute.KeyValue) {
	if cap(*p) > 256 {
		return
	}
	// Drop references to strings. Past the length the array is zero
	// already: append zeroes what it grows, and dedupe what it drops.
	clear(*p)
	*p = (*p)[:0]
	tp.attrPool.Put(p)
}

// newTraceID and newSpanID draw from math/rand/v2's runtime source, which
// is random enough for ids and needs no lock.
func newTraceID() trace.TraceID {
	var id trace.TraceID
	for !id.IsValid() {
		binary.NativeEndian.PutUint64(id[:8], rand.Uint64())
		binary.NativeEndian.PutUint64(id[8:], rand.Uint64())
	}
	return id
}

func newSpanID() trace.SpanID {
	var id trace.SpanID
	for !id.IsValid() {
		binary.NativeEndian.PutUint64(id[:], rand.Uint64())
	}
	return id
}

func unixNano(t time.Time) uint64 {
	return uint64(max(0, t.UnixNano()))
}
