package otlpdirect

import (
	"fmt"
	"reflect"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
)

// span is a recording span. What it records follows the SDK's
// recordingSpan, limits included; End encodes it and hands the bytes to the
// batcher.
type span struct {
	embedded.Span
	tracer *tracer

	mu sync.Mutex
	// ended is set under mu, and read without it by IsRecording: the proxy
	// asks before building the attributes of every call.
	ended         atomic.Bool
	sc, parent    trace.SpanContext
	name          string
	kind          trace.SpanKind
	start, end    time.Time
	attrBuf       *[]attribute.KeyValue // from the provider's pool
	attrs         []attribute.KeyValue  // may hold duplicate keys until End
	droppedAttrs  int
	events        []event
	droppedEvents int
	links         []link
	droppedLinks  int
	status        sdktrace.Status
}

type event struct {
	name    string
	time    time.Time
	attrs   []attribute.KeyValue
	dropped int
}

type link struct {
	sc      trace.SpanContext
	attrs   []attribute.KeyValue
	dropped int
}

func (s *span) SpanContext() trace.SpanContext { return s.sc }

func (s *span) IsRecording() bool { return !s.ended.Load() }

func (s *span) TracerProvider() trace.TracerProvider { return s.tracer.tp }

func (s *span) SetName(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended.Load() {
		s.name = name
	}
}

// SetStatus keeps the highest code set (Unset < Error < Ok), and a
// description only for Error, as the SDK does.
func (s *span) SetStatus(code codes.Code, description string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended.Load() || s.status.Code > code {
		return
	}
	s.status = sdktrace.Status{Code: code}
	if code == codes.Error {
		s.status.Description = description
	}
}

func (s *span) SetAttributes(kvs ...attribute.KeyValue) {
	if len(kvs) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended.Load() {
		s.setAttributes(kvs)
	}
}

// setAttributes appends kvs; duplicates are resolved at End, the last value
// winning in the first one's place. Only when the count limit would be
// exceeded are they resolved now, so that updates to present keys still
// apply and new keys beyond the limit are dropped.
func (s *span) setAttributes(kvs []attribute.KeyValue) {
	limit := s.tracer.tp.limits.AttributeCountLimit
	if limit == 0 {
		s.droppedAttrs += len(kvs)
		return
	}
	if limit > 0 && len(s.attrs)+len(kvs) > limit {
		s.attrs = dedupe(s.attrs)
		for _, kv := range kvs {
			if !kv.Valid() {
				s.droppedAttrs++
				continue
			}
			if i := index(s.attrs, kv.Key); i >= 0 {
				s.attrs[i] = kv
			} else if len(s.attrs) < limit {
				s.attrs = append(s.attrs, kv)
			} else {
				s.droppedAttrs++
			}
		}
		return
	}
	for _, kv := range kvs {
		if !kv.Valid() {
			s.droppedAttrs++
			continue
		}
		s.attrs = append(s.attrs, kv)
	}
}

func index(kvs []attribute.KeyValue, k attribute.Key) int {
	for i := range kvs {
		if kvs[i].Key == k {
			return i
		}
	}
	return -1
}

// dedupe keeps the first position and the last value of each key, in
// place. The spans of a hot path have a couple of dozen attributes at
// most, for which comparing keys beats a map.
func dedupe(kvs []attribute.KeyValue) []attribute.KeyValue {
	if len(kvs) < 2 {
		return kvs
	}
	if len(kvs) > 64 {
		pos := make(map[attribute.Key]int, len(kvs))
		out := kvs[:0]
		for _, kv := range kvs {
			if i, ok := pos[kv.Key]; ok {
				out[i] = kv
				continue
			}
			pos[kv.Key] = len(out)
			out = append(out, kv)
		}
		clear(kvs[len(out):])
		return out
	}
	out := kvs[:0]
	for _, kv := range kvs {
		if i := index(out, kv.Key); i >= 0 {
			out[i] = kv
			continue
		}
		out = append(out, kv)
	}
	clear(kvs[len(out):])
	return out
}

func (s *span) AddEvent(name string, opts ...trace.EventOption) {
	c := trace.NewEventConfig(opts...)
	ev := event{name: name, time: c.Timestamp()}
	ev.attrs, ev.dropped = s.limitAttrs(c.Attributes(), s.tracer.tp.limits.AttributePerEventCountLimit)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended.Load() {
		return
	}
	s.events = appendEvicting(s.events, ev, s.tracer.tp.limits.EventCountLimit, &s.droppedEvents)
}

// appendEvicting appends x to q, which holds limit items at most (-1: no
// limit): over it, the oldest goes, and dropped counts it.
func appendEvicting[T any](q []T, x T, limit int, dropped *int) []T {
	if limit == 0 {
		*dropped++
		return q
	}
	if limit > 0 && len(q) >= limit {
		copy(q, q[1:])
		q = q[:len(q)-1]
		*dropped++
	}
	return append(q, x)
}

// limitAttrs keeps the first limit attributes of an event or a link. Like
// the SDK's (with a value depth limit, its default), it leaves duplicate
// keys to the backend.
func (s *span) limitAttrs(kvs []attribute.KeyValue, limit int) ([]attribute.KeyValue, int) {
	switch {
	case limit == 0:
		return nil, len(kvs)
	case limit > 0 && len(kvs) > limit:
		return kvs[:limit], len(kvs) - limit
	}
	return kvs, 0
}

// RecordError adds an exception event, as the SDK does.
func (s *span) RecordError(err error, opts ...trace.EventOption) {
	if err == nil || !s.IsRecording() {
		return
	}
	opts = append(opts, trace.WithAttributes(
		semconv.ExceptionType(typeString(err)),
		semconv.ExceptionMessage(err.Error()),
	))
	if c := trace.NewEventConfig(opts...); c.StackTrace() {
		stack := make([]byte, 2048)
		opts = append(opts, trace.WithAttributes(semconv.ExceptionStacktrace(string(stack[:runtime.Stack(stack, false)]))))
	}
	s.AddEvent(semconv.ExceptionEventName, opts...)
}

func typeString(v any) string {
	t := reflect.TypeOf(v)
	if t.PkgPath() == "" && t.Name() == "" {
		return t.String()
	}
	return fmt.Sprintf("%s.%s", t.PkgPath(), t.Name())
}

func (s *span) AddLink(l trace.Link) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended.Load() {
		s.addLink(l)
	}
}

func (s *span) addLink(l trace.Link) {
	if !l.SpanContext.IsValid() && len(l.Attributes) == 0 && l.SpanContext.TraceState().Len() == 0 {
		return
	}
	lk := link{sc: l.SpanContext}
	lk.attrs, lk.dropped = s.limitAttrs(l.Attributes, s.tracer.tp.limits.AttributePerLinkCountLimit)
	s.links = appendEvicting(s.links, lk, s.tracer.tp.limits.LinkCountLimit, &s.droppedLinks)
}

// End ends the span and, when it is sampled, encodes it for export. Only
// the first call counts.
func (s *span) End(opts ...trace.SpanEndOption) {
	// The end time first, so that the work below is not in the span; like
	// the SDK, on the monotonic clock when the start has one.
	end := s.start.Add(time.Since(s.start))
	if len(opts) > 0 {
		if c := trace.NewSpanEndConfig(opts...); !c.Timestamp().IsZero() {
			end = c.Timestamp()
		}
	}
	s.mu.Lock()
	if s.ended.Load() {
		s.mu.Unlock()
		return
	}
	s.ended.Store(true)
	s.end = end
	s.attrs = dedupe(s.attrs)
	tp := s.tracer.tp
	if s.sc.IsSampled() {
		tp.batch.add(s)
	}
	*s.attrBuf = s.attrs
	tp.putAttrs(s.attrBuf)
	s.attrBuf, s.attrs, s.events, s.links = nil, nil, nil, nil
	s.mu.Unlock()
}
