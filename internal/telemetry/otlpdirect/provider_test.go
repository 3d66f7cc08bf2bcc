package otlpdirect_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// memExporter keeps the decoded requests; fail, when set, fails exports.
type memExporter struct {
	mu       sync.Mutex
	requests []*coltracepb.ExportTraceServiceRequest
	fail     error
	exported chan struct{} // signalled after each export
}

func newMemExporter() *memExporter { return &memExporter{exported: make(chan struct{}, 100)} }

func (m *memExporter) Export(_ context.Context, b []byte) error {
	req := &coltracepb.ExportTraceServiceRequest{}
	if err := proto.Unmarshal(b, req); err != nil {
		return err
	}
	m.mu.Lock()
	m.requests = append(m.requests, req)
	err := m.fail
	m.mu.Unlock()
	select {
	case m.exported <- struct{}{}:
	default:
	}
	return err
}

func (m *memExporter) Shutdown(context.Context) error { return nil }

// heldExporter holds its first export until release is closed, telling
// entered when it starts.
type heldExporter struct {
	*memExporter
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (h *heldExporter) Export(ctx context.Context, b []byte) error {
	h.once.Do(func() {
		close(h.entered)
		<-h.release
	})
	return h.memExporter.Export(ctx, b)
}

// spanNames are the exported spans' names, per request.
func (m *memExporter) spanNames() [][]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out [][]string
	for _, req := range m.requests {
		var names []string
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				for _, sp := range ss.GetSpans() {
					names = append(names, sp.GetName())
				}
			}
		}
		out = append(out, names)
	}
	return out
}

func TestSampling(t *testing.T) {
	ctx := context.Background()
	unsampledParent := trace.ContextWithRemoteSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: remoteParent.TraceID(), SpanID: remoteParent.SpanID(), Remote: true}))
	sampledParent := trace.ContextWithRemoteSpanContext(ctx, remoteParent)

	for _, tc := range []struct {
		name      string
		sampler   sdktrace.Sampler
		parent    context.Context
		recording bool
		exported  bool
	}{
		{"parent sampled", nil, sampledParent, true, true},
		{"parent not sampled", nil, unsampledParent, false, false},
		{"root, default sampler", nil, ctx, true, true},
		{"always off", sdktrace.NeverSample(), sampledParent, false, false},
		{"record only", recordOnly{}, ctx, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp := newMemExporter()
			tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Sampler: tc.sampler})
			sctx, s := tp.Tracer("test").Start(tc.parent, "span")
			if got := s.IsRecording(); got != tc.recording {
				t.Errorf("IsRecording() = %v, want %v", got, tc.recording)
			}
			sc := s.SpanContext()
			if !sc.IsValid() || sc.SpanID() == remoteParent.SpanID() {
				t.Errorf("span context %v: want a valid one with a span id of its own", sc)
			}
			if tc.parent != ctx && sc.TraceID() != remoteParent.TraceID() {
				t.Errorf("trace id %s, want the parent's %s", sc.TraceID(), remoteParent.TraceID())
			}
			if sc.IsSampled() != tc.exported {
				t.Errorf("sampled flag %v, want %v", sc.IsSampled(), tc.exported)
			}
			if !trace.SpanContextFromContext(sctx).Equal(sc) {
				t.Error("the returned context does not carry the span")
			}
			s.End()
			if err := tp.Shutdown(ctx); err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, names := range exp.spanNames() {
				n += len(names)
			}
			if want := map[bool]int{true: 1, false: 0}[tc.exported]; n != want {
				t.Errorf("%d spans exported, want %d", n, want)
			}
		})
	}
}

type recordOnly struct{}

func (recordOnly) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	return sdktrace.SamplingResult{Decision: sdktrace.RecordOnly, Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
}
func (recordOnly) Description() string { return "RecordOnly" }

func TestStartAttributes(t *testing.T) {
	exp := newMemExporter()
	type key struct{}
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, StartAttributes: func(parent context.Context) []attribute.KeyValue {
		if v, ok := parent.Value(key{}).(string); ok {
			return []attribute.KeyValue{attribute.String("osmo.rollout.id", v)}
		}
		return nil
	}})
	tr := tp.Tracer("test")
	_, a := tr.Start(context.WithValue(context.Background(), key{}, "r-1"), "with")
	a.End()
	_, b := tr.Start(context.Background(), "without")
	b.End()
	if err := tp.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, req := range exp.requests {
		for _, sp := range req.GetResourceSpans()[0].GetScopeSpans()[0].GetSpans() {
			for _, kv := range sp.GetAttributes() {
				got[sp.GetName()] += kv.GetKey() + "=" + kv.GetValue().GetStringValue()
			}
		}
	}
	if got["with"] != "osmo.rollout.id=r-1" || got["without"] != "" {
		t.Errorf("start attributes %v", got)
	}
}

func TestBatching(t *testing.T) {
	ctx := context.Background()
	t.Run("a full batch goes at once", func(t *testing.T) {
		exp := newMemExporter()
		tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Batch: otlpdirect.BatchConfig{Delay: time.Hour, MaxBatch: 3}})
		defer tp.Shutdown(ctx)
		tr := tp.Tracer("test")
		for _, name := range []string{"a", "b", "c"} {
			_, s := tr.Start(ctx, name)
			s.End()
		}
		select {
		case <-exp.exported:
		case <-time.After(10 * time.Second):
			t.Fatal("a full batch was not exported")
		}
		if got := exp.spanNames(); len(got) != 1 || len(got[0]) != 3 || got[0][0] != "a" || got[0][2] != "c" {
			t.Fatalf("exported %v, want [[a b c]]", got)
		}
		_, d := tr.Start(ctx, "d")
		d.End()
		if err := tp.ForceFlush(ctx); err != nil {
			t.Fatal(err)
		}
		if got := exp.spanNames(); len(got) != 2 || len(got[1]) != 1 || got[1][0] != "d" {
			t.Errorf("after ForceFlush: %v, want [[a b c] [d]]", got)
		}
	})
	t.Run("the delay sends what waits", func(t *testing.T) {
		exp := newMemExporter()
		tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Batch: otlpdirect.BatchConfig{Delay: 20 * time.Millisecond}})
		defer tp.Shutdown(ctx)
		_, s := tp.Tracer("test").Start(ctx, "lonely")
		s.End()
		select {
		case <-exp.exported:
		case <-time.After(10 * time.Second):
			t.Fatal("the span was not exported after the delay")
		}
	})
	t.Run("a full queue drops and says so", func(t *testing.T) {
		// The first export is held, so the spans ended meanwhile fill the
		// queue: 4 wait, 2 are dropped. The drop is reported once, by
		// whichever flush takes it: the background one (OnError) or
		// ForceFlush.
		exp := &heldExporter{memExporter: newMemExporter(), entered: make(chan struct{}), release: make(chan struct{})}
		var mu sync.Mutex
		var errs []error
		tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Batch: otlpdirect.BatchConfig{Delay: time.Hour, MaxQueue: 4, MaxBatch: 4},
			OnError: func(err error) { mu.Lock(); errs = append(errs, err); mu.Unlock() }})
		tr := tp.Tracer("test")
		end := func(n int) {
			for range n {
				_, s := tr.Start(ctx, "s")
				s.End()
			}
		}
		end(4)
		select {
		case <-exp.entered:
		case <-time.After(10 * time.Second):
			t.Fatal("a full batch was not exported")
		}
		end(6)
		close(exp.release)
		if err := tp.ForceFlush(ctx); err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		if err := tp.Shutdown(ctx); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "2 spans dropped") {
			t.Errorf("reported %v, want one error saying 2 spans dropped", errs)
		}
		mu.Unlock()
		total := 0
		for _, batch := range exp.spanNames() {
			total += len(batch)
		}
		if total != 8 {
			t.Errorf("exported %d spans (%v), want the 8 queued", total, exp.spanNames())
		}
		_, late := tr.Start(ctx, "late")
		if late.IsRecording() {
			t.Error("a span started after Shutdown records")
		}
		late.End()
		if err := tp.ForceFlush(ctx); err != nil {
			t.Fatal(err)
		}
		if n := len(exp.spanNames()); n != 2 {
			t.Errorf("a span ended after Shutdown was exported: %v", exp.spanNames())
		}
	})
	t.Run("export errors reach OnError", func(t *testing.T) {
		exp := newMemExporter()
		exp.fail = errors.New("collector down")
		reported := make(chan error, 1)
		tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Batch: otlpdirect.BatchConfig{Delay: 10 * time.Millisecond},
			OnError: func(err error) {
				select {
				case reported <- err:
				default:
				}
			}})
		defer tp.Shutdown(ctx)
		_, s := tp.Tracer("test").Start(ctx, "s")
		s.End()
		select {
		case err := <-reported:
			if !errors.Is(err, exp.fail) {
				t.Errorf("OnError got %v, want it to wrap %v", err, exp.fail)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the failed export was not reported")
		}
	})
}

// TestConcurrentSpans ends spans from many goroutines, on two tracers,
// while exports run; every span arrives once, under its scope.
func TestConcurrentSpans(t *testing.T) {
	ctx := context.Background()
	exp := newMemExporter()
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Batch: otlpdirect.BatchConfig{Delay: time.Millisecond, MaxBatch: 7}})
	tracers := []trace.Tracer{tp.Tracer("one"), tp.Tracer("two")}
	const workers, each = 8, 200
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				_, s := tracers[(w+i)%2].Start(ctx, "s", trace.WithAttributes(attribute.Int("w", w), attribute.Int("i", i)))
				s.SetAttributes(attribute.String("x", "y"))
				s.End()
			}
		})
	}
	wg.Wait()
	if err := tp.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	seen := map[[2]int64]int{}
	perScope := map[string]int{}
	exp.mu.Lock()
	defer exp.mu.Unlock()
	for _, req := range exp.requests {
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				for _, sp := range ss.GetSpans() {
					perScope[ss.GetScope().GetName()]++
					a := sp.GetAttributes()
					seen[[2]int64{a[0].GetValue().GetIntValue(), a[1].GetValue().GetIntValue()}]++
				}
			}
		}
	}
	if len(seen) != workers*each {
		t.Errorf("%d distinct spans exported, want %d", len(seen), workers*each)
	}
	for k, n := range seen {
		if n != 1 {
			t.Errorf("span %v exported %d times", k, n)
		}
	}
	if perScope["one"] != workers*each/2 || perScope["two"] != workers*each/2 {
		t.Errorf("spans per scope %v, want %d each", perScope, workers*each/2)
	}
}
