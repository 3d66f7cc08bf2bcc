package planebench

import (
	"bytes"
	"context"
	"hash/fnv"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// stickyPlane is a plane small enough to trust for testing the bench:
// each sample hashed to an engine, the next one tried when it refuses or
// answers 5xx.
func stickyPlane(_ context.Context, engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (Plane, error) {
	c := &http.Client{Transport: tr}
	return Plane{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		h := fnv.New32a()
		_, _ = io.WriteString(h, r.Header.Get(llmproxy.HeaderRolloutID)+"/"+r.Header.Get(llmproxy.HeaderSampleID))
		first := int(h.Sum32() % uint32(len(engines)))
		for i := range engines {
			req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, engines[(first+i)%len(engines)]+"/chat/completions", bytes.NewReader(body))
			for _, k := range []string{"Content-Type", llmproxy.HeaderRolloutID, llmproxy.HeaderSampleID} {
				req.Header.Set(k, r.Header.Get(k))
			}
			resp, err := c.Do(req)
			if err != nil {
				continue
			}
			b, err := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if err != nil || resp.StatusCode >= 500 {
				continue
			}
			w.WriteHeader(resp.StatusCode)
			_, _ = w.Write(b)
			rec.RecordCall(r.Context(), &osmo.LLMCall{RolloutID: r.Header.Get(llmproxy.HeaderRolloutID), SampleID: r.Header.Get(llmproxy.HeaderSampleID), StatusCode: resp.StatusCode})
			return
		}
		http.Error(w, "no engine answered", http.StatusBadGateway)
	})}, nil
}

func small(plane PlaneFunc) Config {
	return Config{Requests: 200, Clients: 4, Samples: 80, SkewClients: 8, LongCalls: 8, Rollouts: 200, KillEngines: 4, Plane: plane}
}

// TestMeasure runs the bench against a sticky plane: every call lands on
// its sample's engine, and the killed engine's calls move without a loss
// or a second answer.
func TestMeasure(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rep, err := Measure(ctx, small(stickyPlane))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []Setup{rep.Direct, rep.Single, rep.Plane1, rep.Plane8} {
		if s.Skipped != "" || s.P99 <= 0 || s.P50 > s.P99 || s.PerSecond <= 0 {
			t.Errorf("setup %s (%d engines): %+v", s.Name, s.Engines, s)
		}
	}
	if rep.AddedP99Ratio() == 0 && rep.AddedP99(rep.Single) > 0 {
		t.Errorf("no added p99 ratio: %+v", rep)
	}
	b := rep.Balance
	wantCalls := 8*8 + 72*2
	if b.Skipped != "" || b.Calls != wantCalls || b.Affinity != 1 || b.MaxMean < 1 || b.MaxMean > 8 {
		t.Errorf("balance %+v, want %d calls all on their sample's engine", b, wantCalls)
	}
	k := rep.Kill
	if k.Skipped != "" || k.Lost != 0 || k.Twice != 0 || k.Cut < 1 || k.Calls != 600 {
		t.Errorf("kill %+v, want 0 lost, 0 twice, at least 1 call cut", k)
	}
	var out strings.Builder
	rep.WriteTable(&out)
	for _, want := range []string{"single upstream", "plane", "affinity: 100.00%", "0 lost, 0 answered twice"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

// TestMeasureFindsLoss: a plane without failover loses the killed
// engine's rollouts, and the bench says so.
func TestMeasureFindsLoss(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	noFailover := func(ctx context.Context, engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (Plane, error) {
		return stickyPlane(ctx, engines[:1], tr, rec) // every sample on engine 0, which dies
	}
	k, err := measureKill(ctx, small(noFailover).withDefaults())
	if err != nil {
		t.Fatal(err)
	}
	if k.Lost == 0 {
		t.Errorf("a plane without failover lost nothing: %+v", k)
	}
	twice := func(ctx context.Context, engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (Plane, error) {
		// Records every answered call twice, as a plane that kept both
		// attempts of a resent call as answers would.
		double := llmproxy.RecorderFunc(func(ctx context.Context, c *osmo.LLMCall) { rec.RecordCall(ctx, c); rec.RecordCall(ctx, c) })
		return stickyPlane(ctx, engines, tr, double)
	}
	k, err = measureKill(ctx, small(twice).withDefaults())
	if err != nil {
		t.Fatal(err)
	}
	if k.Twice != k.Calls || k.Lost != 0 {
		t.Errorf("a plane recording each call twice: %+v, want %d twice", k, k.Calls)
	}
}

// TestMeasurePlane runs the bench against the proxy's own engine set:
// with the engines healthy every call of a sample lands on one engine and
// no engine carries more than the bound allows; with one killed mid-run
// nothing is lost and nothing answered twice.
func TestMeasurePlane(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	// The skewed run at its full size: with 80 samples a few long ones
	// decide the busiest engine whatever the ring does.
	cfg := small(NewPlane)
	cfg.Samples, cfg.LongCalls = 0, 0
	rep, err := Measure(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []Setup{rep.Single, rep.Plane1, rep.Plane8} {
		if s.Skipped != "" || s.P99 <= 0 || s.PerSecond <= 0 {
			t.Errorf("setup %s (%d engines): %+v", s.Name, s.Engines, s)
		}
	}
	// The bound holds calls in flight to 1.25 × the mean at any moment;
	// the calls an engine answers over the whole run also follow where
	// the long samples hashed, and vary from run to run (1.1 to 1.45 seen
	// here, against 1.5 and more for plain hashing): the target of 1.3 is
	// the bench's to report, a test bounds the spread.
	if b := rep.Balance; b.Skipped != "" || b.Affinity < 0.99 || b.MaxMean > 1.5 {
		t.Errorf("balance %+v, want affinity at least 99%% and max/mean at most 1.5", b)
	}
	if k := rep.Kill; k.Skipped != "" || k.Lost != 0 || k.Twice != 0 || k.Cut < 1 {
		t.Errorf("kill %+v, want 0 lost, 0 twice, at least 1 call cut", k)
	}
}
