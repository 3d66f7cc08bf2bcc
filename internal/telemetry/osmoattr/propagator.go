package osmoattr

import (
	"context"
	"hash/maphash"
	"sync/atomic"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
)

// NewBaggagePropagator returns a W3C baggage propagator that behaves as
// propagation.Baggage but remembers the headers it parsed.
//
// Every call of a rollout carries the same baggage (its rollout and sample
// ids), and parsing it and encoding it again for the next hop were, after
// the upstream call itself, the largest cost of a call the LLM proxy does
// not record: extracting such a header with the trace context and
// injecting both took 2.1 µs and 21 allocations with propagation.Baggage,
// 0.66 µs and 10 with this one (BenchmarkBaggagePropagator). Parsed
// baggage is immutable, so calls share it.
func NewBaggagePropagator() propagation.TextMapPropagator {
	return &baggagePropagator{seed: maphash.MakeSeed()}
}

const (
	// baggageSlots is the size of the cache, which keeps the last header
	// seen per slot: enough for the rollouts one process serves at once.
	baggageSlots = 1024
	// maxCachedBaggage bounds the headers cached, and so its memory; longer
	// ones are parsed every time.
	maxCachedBaggage = 512
)

type baggagePropagator struct {
	seed  maphash.Seed
	slots [baggageSlots]atomic.Pointer[parsedBaggage]
}

// parsedBaggage is a header and what it means. It is not changed once
// cached.
type parsedBaggage struct {
	header string
	bag    baggage.Baggage
	// encoded is bag as Inject writes it.
	encoded string
	// members are bag's members, none of which has properties.
	members []struct{ key, value string }
}

// parsedKey is the context key of the parsedBaggage a context's baggage
// was extracted from.
type parsedKey struct{}

func (*baggagePropagator) Fields() []string { return propagation.Baggage{}.Fields() }

func (p *baggagePropagator) Extract(parent context.Context, carrier propagation.TextMapCarrier) context.Context {
	if vg, ok := carrier.(propagation.ValuesGetter); ok && len(vg.Values("baggage")) > 1 {
		return propagation.Baggage{}.Extract(parent, carrier)
	}
	h := carrier.Get("baggage")
	if h == "" || len(h) > maxCachedBaggage {
		return propagation.Baggage{}.Extract(parent, carrier)
	}
	slot := &p.slots[maphash.String(p.seed, h)%baggageSlots]
	pb := slot.Load()
	if pb == nil || pb.header != h {
		if pb = parseBaggage(h); pb == nil {
			// Invalid, empty or with properties: the standard way, which
			// also reports errors.
			return propagation.Baggage{}.Extract(parent, carrier)
		}
		slot.Store(pb)
	}
	return context.WithValue(baggage.ContextWithBaggage(parent, pb.bag), parsedKey{}, pb)
}

func parseBaggage(h string) *parsedBaggage {
	bag, err := baggage.Parse(h)
	if err != nil || bag.Len() == 0 {
		return nil
	}
	pb := &parsedBaggage{header: h, bag: bag, encoded: bag.String()}
	for _, m := range bag.Members() {
		if len(m.Properties()) > 0 {
			return nil
		}
		pb.members = append(pb.members, struct{ key, value string }{m.Key(), m.Value()})
	}
	return pb
}

func (p *baggagePropagator) Inject(ctx context.Context, carrier propagation.TextMapCarrier) {
	bag := baggage.FromContext(ctx)
	if bag.Len() == 0 {
		return
	}
	// The baggage extracted, unless it was changed since.
	if pb, ok := ctx.Value(parsedKey{}).(*parsedBaggage); ok && pb.is(bag) {
		carrier.Set("baggage", pb.encoded)
		return
	}
	propagation.Baggage{}.Inject(ctx, carrier)
}

// is reports whether bag has the same members as pb.
func (pb *parsedBaggage) is(bag baggage.Baggage) bool {
	if bag.Len() != len(pb.members) {
		return false
	}
	for _, kv := range pb.members {
		m := bag.Member(kv.key)
		if m.Value() != kv.value || len(m.Properties()) > 0 {
			return false
		}
	}
	return true
}
