package osmoattr_test

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"

	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// members lists a baggage as sorted key=value;properties strings.
func members(b baggage.Baggage) []string {
	var out []string
	for _, m := range b.Members() {
		out = append(out, m.String())
	}
	sort.Strings(out)
	return out
}

// TestBaggagePropagatorMatchesStandard: the cached propagator extracts and
// injects what propagation.Baggage does, the first time and from cache.
func TestBaggagePropagatorMatchesStandard(t *testing.T) {
	std := propagation.Baggage{}
	p := osmoattr.NewBaggagePropagator()
	long := "k=" + strings.Repeat("v", 600)
	for _, header := range [][]string{
		nil,
		{""},
		{"osmo.rollout.id=r-1,osmo.sample.id=s-1"},
		{"osmo.rollout.id=r%201 , osmo.sample.id=s%2F1,other=x"},
		{"a=1;prop=2,b=2"},      // properties: not cached
		{"a=1,=bad,b=2"},        // an invalid member is dropped
		{"a=1,a=2"},             // the last one wins
		{"a=1", "b=2"},          // several headers
		{long},                  // too long to cache
		{"osmo.rollout.id=r-1"}, // a second entry
	} {
		for round := range 2 {
			t.Run(fmt.Sprintf("%q/%d", header, round), func(t *testing.T) {
				// propagation.HeaderCarrier reads several values, a
				// MapCarrier one.
				carriers := []propagation.TextMapCarrier{propagation.HeaderCarrier(http.Header{"Baggage": header})}
				if len(header) == 1 {
					carriers = append(carriers, propagation.MapCarrier{"baggage": header[0]})
				}
				for _, c := range carriers {
					want := std.Extract(context.Background(), c)
					got := p.Extract(context.Background(), c)
					if w, g := members(baggage.FromContext(want)), members(baggage.FromContext(got)); strings.Join(w, ",") != strings.Join(g, ",") {
						t.Fatalf("%T: extracted %v, want %v", c, g, w)
					}
					wantOut, gotOut := propagation.MapCarrier{}, propagation.MapCarrier{}
					std.Inject(want, wantOut)
					p.Inject(got, gotOut)
					wb, _ := baggage.Parse(wantOut["baggage"])
					gb, _ := baggage.Parse(gotOut["baggage"])
					if w, g := members(wb), members(gb); strings.Join(w, ",") != strings.Join(g, ",") || (wantOut["baggage"] == "") != (gotOut["baggage"] == "") {
						t.Errorf("%T: injected %q, want %q", c, gotOut["baggage"], wantOut["baggage"])
					}
				}
			})
		}
	}
}

// TestBaggagePropagatorChangedBaggage: baggage changed after extraction is
// injected as it is now, not as it was received.
func TestBaggagePropagatorChangedBaggage(t *testing.T) {
	p := osmoattr.NewBaggagePropagator()
	c := propagation.MapCarrier{"baggage": "osmo.rollout.id=r-1,osmo.sample.id=s-1"}
	for _, tc := range []struct {
		name   string
		change func(context.Context) context.Context
		want   string
	}{
		{"new sample", func(ctx context.Context) context.Context { return osmoattr.ContextWithIDs(ctx, "r-1", "s-2") }, "osmo.rollout.id=r-1,osmo.sample.id=s-2"},
		{"member added", func(ctx context.Context) context.Context {
			m, _ := baggage.NewMemberRaw("x", "y")
			b, _ := baggage.FromContext(ctx).SetMember(m)
			return baggage.ContextWithBaggage(ctx, b)
		}, "osmo.rollout.id=r-1,osmo.sample.id=s-1,x=y"},
		{"member removed", func(ctx context.Context) context.Context {
			return baggage.ContextWithBaggage(ctx, baggage.FromContext(ctx).DeleteMember("osmo.sample.id"))
		}, "osmo.rollout.id=r-1"},
		{"property added", func(ctx context.Context) context.Context {
			prop, _ := baggage.NewKeyProperty("p")
			m, _ := baggage.NewMemberRaw("osmo.sample.id", "s-1", prop)
			b, _ := baggage.FromContext(ctx).SetMember(m)
			return baggage.ContextWithBaggage(ctx, b)
		}, "osmo.rollout.id=r-1,osmo.sample.id=s-1;p"},
		{"removed", func(ctx context.Context) context.Context { return baggage.ContextWithBaggage(ctx, baggage.Baggage{}) }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := tc.change(p.Extract(context.Background(), c))
			out := propagation.MapCarrier{}
			p.Inject(ctx, out)
			got, _ := baggage.Parse(out["baggage"])
			want, _ := baggage.Parse(tc.want)
			if strings.Join(members(got), ",") != strings.Join(members(want), ",") {
				t.Errorf("injected %q, want %q", out["baggage"], tc.want)
			}
		})
	}
}

// TestBaggagePropagatorConcurrent extracts and injects colliding headers from
// many goroutines (run with -race).
func TestBaggagePropagatorConcurrent(t *testing.T) {
	p := osmoattr.NewBaggagePropagator()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 3000 {
				h := fmt.Sprintf("osmo.rollout.id=r-%d,osmo.sample.id=s-%d", (i*7+g)%2000, g)
				ctx := p.Extract(context.Background(), propagation.MapCarrier{"baggage": h})
				out := propagation.MapCarrier{}
				p.Inject(ctx, out)
				b, err := baggage.Parse(out["baggage"])
				if err != nil || b.Member("osmo.rollout.id").Value() != fmt.Sprintf("r-%d", (i*7+g)%2000) || b.Member("osmo.sample.id").Value() != fmt.Sprintf("s-%d", g) {
					t.Errorf("%q came out as %q (%v)", h, out["baggage"], err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// BenchmarkBaggagePropagator extracts a rollout's trace context and baggage
// and injects them for the next hop, as the LLM proxy does per call.
func BenchmarkBaggagePropagator(b *testing.B) {
	in := http.Header{
		"Traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		"Baggage":     {"osmo.rollout.id=7f9c2a4e-5b1d-4e8a-9c3f-2d6b8e1a4f70,osmo.sample.id=s-3"},
	}
	for _, tc := range []struct {
		name string
		bag  propagation.TextMapPropagator
	}{
		{"standard", propagation.Baggage{}},
		{"cached", osmoattr.NewBaggagePropagator()},
	} {
		b.Run(tc.name, func(b *testing.B) {
			p := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, tc.bag)
			out := propagation.MapCarrier{}
			b.ReportAllocs()
			for b.Loop() {
				ctx := p.Extract(context.Background(), propagation.HeaderCarrier(in))
				p.Inject(ctx, out)
			}
		})
	}
}
