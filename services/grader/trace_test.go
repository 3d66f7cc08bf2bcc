package grader_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/services/grader"
)

func tracing(t *testing.T) (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, exp
}

func spanAttrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

func spansByName(exp *tracetest.InMemoryExporter) map[string][]tracetest.SpanStub {
	out := map[string][]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		out[s.Name] = append(out[s.Name], s)
	}
	return out
}

// TestGradeStreamTraceContext: the client puts its caller's trace into the
// request; the service's "grade" span continues it over the long-lived
// stream, with the grader run inside, both tagged with the ids.
func TestGradeStreamTraceContext(t *testing.T) {
	tp, exp := tracing(t)
	ctx := testContext(t)
	g := newCounter(func(ctx context.Context, gc *osmo.GraderContext) error {
		// The grader's own context is the run's span.
		if !trace.SpanFromContext(ctx).SpanContext().IsValid() {
			t.Error("the grader ran without the run span in its context")
		}
		return gc.SetSampleReward("s0", 0.5)
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g", TracerProvider: tp})
	c := grader.NewClient(dial(t, ts.addr), grader.ClientOptions{Logger: quietLogger()})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })

	callerCtx, caller := tp.Tracer("test").Start(osmoattr.ContextWithIDs(ctx, "r1", "s0"), "caller", trace.WithSpanKind(trace.SpanKindClient))
	req := gradeReq(t, "r1", "x", "answer")
	resp, err := c.Grade(callerCtx, req)
	caller.End()
	if err != nil || resp.GetError() != "" {
		t.Fatalf("Grade: %v %v", resp, err)
	}
	if len(req.GetTraceContext()) != 0 {
		t.Error("Grade wrote the trace context into the caller's request")
	}

	// The service ends its span after sending the answer on the stream,
	// so the client can be first.
	waitFor(t, "the grade span", func() bool { return len(spansByName(exp)["grade"]) > 0 })
	spans := spansByName(exp)
	grade, run := spans["grade"], spans["run_grader g"]
	if len(grade) != 1 || len(run) != 1 {
		t.Fatalf("spans %v, want one grade and one run_grader g", spans)
	}
	gs, rs := grade[0], run[0]
	if gs.SpanKind != trace.SpanKindServer || gs.Parent.SpanID() != caller.SpanContext().SpanID() || gs.SpanContext.TraceID() != caller.SpanContext().TraceID() {
		t.Errorf("grade span kind %v parent %v, want a server span under the caller %v", gs.SpanKind, gs.Parent, caller.SpanContext())
	}
	if rs.Parent.SpanID() != gs.SpanContext.SpanID() {
		t.Errorf("run span's parent %v, want the grade span", rs.Parent.SpanID())
	}
	for name, s := range map[string]tracetest.SpanStub{"grade": gs, "run": rs} {
		a := spanAttrs(s)
		if a["osmo.rollout.id"].AsString() != "r1" || a["osmo.sample.id"].AsString() != "s0" || a["osmo.reward"].AsFloat64() != 0.5 || a["osmo.grader.name"].AsString() != "g" {
			t.Errorf("%s span attributes %v", name, a)
		}
	}
}

func TestGradeSpanErrors(t *testing.T) {
	tp, exp := tracing(t)
	ctx := testContext(t)
	g := newCounter(func(context.Context, *osmo.GraderContext) error { return errBoom })
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g", TracerProvider: tp})
	client := stub(t, ts)

	// Grade over the unary call: the request's trace_context still wins.
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{7}, SpanID: trace.SpanID{8}, TraceFlags: trace.FlagsSampled})
	carrier := propagation.MapCarrier{}
	telemetry.Propagator().Inject(trace.ContextWithSpanContext(ctx, sc), carrier)
	req := gradeReq(t, "r2", "x", "answer")
	req.TraceContext = carrier
	resp, err := client.Grade(ctx, req)
	if err != nil || resp.GetError() == "" {
		t.Fatalf("Grade: %v %v, want the grader's failure", resp, err)
	}
	spans := spansByName(exp)
	for _, name := range []string{"grade", "run_grader g"} {
		if len(spans[name]) != 1 {
			t.Fatalf("spans %v", spans)
		}
		s := spans[name][0]
		if s.Status.Code != codes.Error || spanAttrs(s)["error.type"].AsString() != "grader_error" {
			t.Errorf("%s: status %v error.type %v, want a grader_error", name, s.Status, spanAttrs(s)["error.type"])
		}
		if s.SpanContext.TraceID() != sc.TraceID() {
			t.Errorf("%s is in trace %v, want the request's %v", name, s.SpanContext.TraceID(), sc.TraceID())
		}
	}

	exp.Reset()
	if _, err := client.Grade(ctx, gradeReq(t, "", "x", "a")); err == nil {
		t.Fatal("an invalid request was accepted")
	}
	spans = spansByName(exp)
	if len(spans["grade"]) != 1 || spanAttrs(spans["grade"][0])["error.type"].AsString() != "InvalidArgument" || len(spans["run_grader g"]) != 0 {
		t.Errorf("invalid request: spans %v, want a failed grade span and no run", spans)
	}
}

func TestGradeCachedAnswerSpan(t *testing.T) {
	tp, exp := tracing(t)
	ctx := testContext(t)
	g := newCounter(nil)
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g", TracerProvider: tp})
	client := stub(t, ts)
	for range 2 {
		if _, err := client.Grade(ctx, gradeReq(t, "r3", "x", "a")); err != nil {
			t.Fatal(err)
		}
	}
	spans := spansByName(exp)
	if len(spans["grade"]) != 2 || len(spans["run_grader g"]) != 1 {
		t.Fatalf("spans %v, want two grade spans and one grader run", spans)
	}
	if !spanAttrs(spans["grade"][1])["osmo.grade.cached"].AsBool() || spanAttrs(spans["grade"][0])["osmo.grade.cached"].AsBool() {
		t.Error("osmo.grade.cached does not tell the resend from the first grading")
	}
}
