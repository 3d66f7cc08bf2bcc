package rollout

import (
	"context"
	"math"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	otelcodes "go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

const tracerName = "github.com/osmo-rl/osmo/services/rollout"

// noSpan stands in for spans when tracing is off.
var noSpan = trace.SpanFromContext(context.Background())

// traceRollout starts the rollout's span under the request's span in ctx,
// kept on the record with the baggage carrying its id (see traced).
func (s *Service) traceRollout(ctx context.Context, rec *record) {
	if s.tracer == nil {
		return
	}
	tagRolloutID(ctx, rec.id)
	// An agent loop's one sample is named before it runs.
	sampleID := osmo.Hosting().LoopSampleID(s.workflow)
	ctx = osmoattr.ContextWithIDs(ctx, rec.id, sampleID)
	rec.bag = baggage.FromContext(ctx)
	_, rec.span = s.tracer.Start(ctx, "rollout", trace.WithAttributes(
		osmoattr.RolloutID.String(rec.id),
		osmoattr.Workflow.String(rec.workflow),
		osmoattr.Wire.String(rec.wire.name()),
	))
	if sampleID != "" {
		rec.span.SetAttributes(osmoattr.SampleID.String(sampleID))
	}
}

// tagRolloutID puts the rollout id on the span of the call in ctx, which
// started before the id was known, unless the gateway put it into the
// baggage.
func tagRolloutID(ctx context.Context, id string) {
	if baggage.FromContext(ctx).Member(string(osmoattr.RolloutID)).Value() != id {
		trace.SpanFromContext(ctx).SetAttributes(osmoattr.RolloutID.String(id))
	}
}

// traced returns parent carrying the rollout's span and id baggage.
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

// endRolloutSpan records the outcome on the rollout's span and ends it.
func endRolloutSpan(rec *record, status string, o outcome.Outcome) {
	span := rec.rolloutSpan()
	if span.IsRecording() {
		rec.mu.Lock()
		reward, m := rec.reward, rec.metricsLocked(rec.finished)
		finish := ""
		if len(rec.samples) > 0 {
			finish = rec.samples[0].FinishReason
		}
		rec.mu.Unlock()
		attrs := []attribute.KeyValue{
			osmoattr.RolloutStatus.String(status),
			attribute.Int("osmo.rollout.llm_calls", m.NumLLMCalls),
			attribute.Int("osmo.rollout.tool_calls", m.NumToolCalls),
			semconv.GenAIUsageInputTokens(m.PromptTokens),
			semconv.GenAIUsageOutputTokens(m.ResponseTokens),
		}
		if finish != "" {
			attrs = append(attrs, osmoattr.FinishReason.String(finish))
		}
		if reward != nil && !math.IsNaN(*reward) {
			attrs = append(attrs, osmoattr.Reward.Float64(*reward))
		}
		span.SetAttributes(attrs...)
		if !o.OK() {
			span.SetAttributes(osmoattr.ErrorCategory.String(string(o.Category)))
			fail(span, string(o.Category), o.Message)
		}
	}
	span.End()
}
