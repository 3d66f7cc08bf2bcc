package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// BaggageAttributes is a span processor that copies the osmo.rollout.id and
// osmo.sample.id baggage members of a span's parent context onto the span
// as attributes. The services put the ids into baggage where they learn
// them, and baggage travels with the trace context, so every span of a
// rollout, automatic HTTP and gRPC spans included, can be found by
// osmo.rollout.id.
func BaggageAttributes() sdktrace.SpanProcessor { return baggageAttributes{} }

type baggageAttributes struct{}

func (baggageAttributes) OnStart(parent context.Context, s sdktrace.ReadWriteSpan) {
	// One call: each one grows the span's attribute slice.
	if attrs := baggageIDs(parent); len(attrs) > 0 {
		s.SetAttributes(attrs...)
	}
}

// baggageIDs are the id attributes of the baggage in ctx.
func baggageIDs(ctx context.Context) []attribute.KeyValue {
	bag := baggage.FromContext(ctx)
	if bag.Len() == 0 {
		return nil
	}
	return osmoattr.IDAttributes(bag.Member(string(osmoattr.RolloutID)).Value(), bag.Member(string(osmoattr.SampleID)).Value())
}

func (baggageAttributes) OnEnd(sdktrace.ReadOnlySpan)      {}
func (baggageAttributes) Shutdown(context.Context) error   { return nil }
func (baggageAttributes) ForceFlush(context.Context) error { return nil }
