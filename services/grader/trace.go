package grader

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/status"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

const tracerName = "github.com/osmo-rl/osmo/services/grader"

// startGrade starts the "grade" span of one request, parented on its
// trace_context when it has one, else on the call's own span.
func (s *Service) startGrade(ctx context.Context, req *graderv1.GradeRequest, r *request) (context.Context, trace.Span) {
	kind := trace.SpanKindInternal
	if tc := req.GetTraceContext(); len(tc) > 0 {
		ctx = s.prop.Extract(ctx, propagation.MapCarrier(tc))
		if sc := trace.SpanContextFromContext(ctx); sc.IsValid() && sc.IsRemote() {
			kind = trace.SpanKindServer
		}
	}
	sampleID, n := "", 0
	if r != nil {
		if n = len(r.samples); n == 1 {
			sampleID = r.samples[0].ID
		}
	}
	ctx = osmoattr.ContextWithIDs(ctx, req.GetRolloutId(), sampleID)
	attrs := append(osmoattr.IDAttributes(req.GetRolloutId(), sampleID), osmoattr.GradeSamples.Int(n))
	if req.GetGrader() != "" {
		attrs = append(attrs, osmoattr.GraderName.String(req.GetGrader()))
	}
	return s.tracer.Start(ctx, "grade", trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
}

// endGrade records a request's answer on its span.
func endGrade(span trace.Span, resp *graderv1.GradeResponse, err error) {
	if !span.IsRecording() {
		return
	}
	switch {
	case err != nil:
		st := status.Convert(err)
		span.SetAttributes(semconv.ErrorTypeKey.String(st.Code().String()))
		span.SetStatus(otelcodes.Error, st.Message())
		return
	case resp.GetError() != "":
		span.SetAttributes(osmoattr.GraderName.String(resp.GetGrader()), semconv.ErrorTypeKey.String("grader_error"))
		span.SetStatus(otelcodes.Error, resp.GetError())
		return
	}
	span.SetAttributes(osmoattr.GraderName.String(resp.GetGrader()))
	for _, g := range resp.GetGrades() {
		recordSample(span, len(resp.GetGrades()), g.GetSampleId(), g.GetRemoveSample(), g.Reward, osmoattr.GradeCached.Bool(g.GetCached()))
	}
}

// recordSample puts one of n samples' outcome on span: as attributes when
// it is the only one, else as a "sample_graded" event naming it.
func recordSample(span trace.Span, n int, id string, remove bool, reward *float64, attrs ...attribute.KeyValue) {
	attrs = append(attrs, osmoattr.RemoveSample.Bool(remove))
	if reward != nil {
		attrs = append(attrs, osmoattr.Reward.Float64(*reward))
	}
	if n == 1 {
		span.SetAttributes(attrs...)
		return
	}
	span.AddEvent("sample_graded", trace.WithAttributes(append(attrs, osmoattr.SampleID.String(id))...))
}

// startRun starts the span of one grader run under ctx (the service's),
// parented on the span and baggage of tctx (the request that led the run).
func (s *Service) startRun(ctx, tctx context.Context, name string, samples int) (context.Context, trace.Span) {
	if bag := baggage.FromContext(tctx); bag.Len() > 0 {
		ctx = baggage.ContextWithBaggage(ctx, bag)
	}
	ctx = trace.ContextWithSpan(ctx, trace.SpanFromContext(tctx))
	return s.tracer.Start(ctx, "run_grader "+name, trace.WithAttributes(
		osmoattr.GraderName.String(name), osmoattr.GradeSamples.Int(samples)))
}

// endRun records a grading on its span.
func endRun(span trace.Span, gr *grading, err error) {
	if !span.IsRecording() {
		return
	}
	if err != nil {
		span.SetAttributes(semconv.ErrorTypeKey.String("shutdown"))
		span.SetStatus(otelcodes.Error, err.Error())
		return
	}
	if gr.Error != "" {
		span.SetAttributes(semconv.ErrorTypeKey.String("grader_error"))
		span.SetStatus(otelcodes.Error, gr.Error)
		return
	}
	for _, r := range gr.Samples {
		recordSample(span, len(gr.Samples), r.ID, r.Remove, r.Reward)
	}
}
