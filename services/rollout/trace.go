package rollout

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	otelcodes "go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

const tracerName = "github.com/osmo-rl/osmo/services/rollout"

// noSpan stands in for spans when tracing is off.
var noSpan = trace.SpanFromContext(context.Background())

// startRollout starts the rollout's span under the InitRollout call's span
// in ctx. The run happens after InitRollout returns, so the span and the
// baggage carrying the ids are kept on the record (see traced).
func (s *Service) startRollout(ctx context.Context, rec *record) {
	if s.tracer == nil {
		return
	}
	// The call's span started before anyone knew the id, unless the
	// gateway put it into the baggage.
	if baggage.FromContext(ctx).Member(string(osmoattr.RolloutID)).Value() != rec.id {
		trace.SpanFromContext(ctx).SetAttributes(osmoattr.RolloutID.String(rec.id))
	}
	ctx = osmoattr.ContextWithIDs(ctx, rec.id, rec.sampleID)
	rec.bag = baggage.FromContext(ctx)
	_, rec.span = s.tracer.Start(ctx, "rollout", trace.WithAttributes(
		osmoattr.RolloutID.String(rec.id),
		osmoattr.Workflow.String(rec.workflow),
	))
	if rec.sampleID != "" {
		rec.span.SetAttributes(osmoattr.SampleID.String(rec.sampleID))
	}
}

// traced returns parent carrying the rollout's span and id baggage, so what
// runs under it joins the rollout's trace; parent itself when not tracing.
func (r *record) traced(parent context.Context) context.Context {
	if r.span == nil {
		return parent
	}
	return trace.ContextWithSpan(baggage.ContextWithBaggage(parent, r.bag), r.span)
}

// rolloutSpan is the rollout's span, a no-op one when not tracing.
func (r *record) rolloutSpan() trace.Span {
	if r.span == nil {
		return noSpan
	}
	return r.span
}

// startSpan starts a span of the rollout service; a no-op one when not
// tracing.
func (s *Service) startSpan(ctx context.Context, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if s.tracer == nil {
		return ctx, noSpan
	}
	return s.tracer.Start(ctx, name, trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
}

// fail marks span failed with error.type typ.
func fail(span trace.Span, typ, msg string) {
	span.SetAttributes(semconv.ErrorTypeKey.String(typ))
	span.SetStatus(otelcodes.Error, msg)
}

// endRollout records the outcome on the rollout's span and ends it.
func endRollout(span trace.Span, out *outcome, m *completionStats) {
	if !span.IsRecording() {
		return
	}
	attrs := []attribute.KeyValue{osmoattr.RolloutStatus.String(out.status)}
	if out.finish != "" {
		attrs = append(attrs, osmoattr.FinishReason.String(out.finish))
	}
	if out.reward != nil {
		attrs = append(attrs, osmoattr.Reward.Float64(*out.reward))
	}
	if m != nil {
		attrs = append(attrs,
			attribute.Int("osmo.rollout.llm_calls", m.NumLLMCalls),
			attribute.Int("osmo.rollout.tool_calls", m.NumToolCalls),
			semconv.GenAIUsageInputTokens(m.PromptTokens),
			semconv.GenAIUsageOutputTokens(m.ResponseTokens),
		)
	}
	span.SetAttributes(attrs...)
	if out.status == osmo.StatusError {
		span.SetAttributes(osmoattr.ErrorCategory.String(out.category))
		fail(span, out.category, out.errMsg)
	}
	span.End()
}

// endWorkflowSpan records a G2 outcome on the rollout's span and ends it.
func endWorkflowSpan(span trace.Span, out *wfOutcome, reward *float64) {
	if span.IsRecording() {
		span.SetAttributes(osmoattr.RolloutStatus.String(out.status))
		if reward != nil {
			span.SetAttributes(osmoattr.Reward.Float64(*reward))
		}
		if out.status != "success" {
			span.SetAttributes(osmoattr.ErrorCategory.String(out.category))
			fail(span, out.category, out.errMsg)
		}
	}
	span.End()
}
