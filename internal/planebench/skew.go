package planebench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// served is a plane served on loopback.
type served struct {
	target string               // its chat completions URL
	ended  func(rollout string) // never nil
	stop   func()
}

// plane starts the plane over f's engines, or says why it skipped: there
// is no plane to measure.
func plane(ctx context.Context, cfg Config, f *fleet, rec llmproxy.Recorder) (p served, skipped string, err error) {
	if cfg.Plane == nil {
		return p, "no engine set to measure", nil
	}
	tr := llmproxy.DefaultTransport()
	pctx, cancel := context.WithCancel(ctx)
	h, err := cfg.Plane(pctx, f.urls(), tr, rec)
	if err != nil {
		cancel()
		return p, "", fmt.Errorf("planebench: building the plane: %w", err)
	}
	u, stopServer, err := serve(h)
	if err != nil {
		cancel()
		return p, "", err
	}
	p = served{target: u + "/v1/chat/completions", ended: h.Ended, stop: func() { stopServer(); cancel(); tr.CloseIdleConnections() }}
	if p.ended == nil {
		p.ended = func(string) {}
	}
	return p, "", nil
}

// sample is one sample of the skewed or kill runs: calls sent one after
// the other, as an agent sends its turns.
type sample struct {
	rollout, id string
	calls       int
}

// runSamples plays samples with clients at a time, and tells the plane
// when the last sample of a rollout is done; it returns how many failed
// (one call without an answer fails its sample).
func runSamples(ctx context.Context, a *agent, p served, clients int, samples []sample) int {
	next := make(chan sample)
	var (
		mu     sync.Mutex
		failed int
		wg     sync.WaitGroup
		left   = map[string]int{} // samples of each rollout not done
	)
	for _, s := range samples {
		left[s.rollout]++
	}
	for range clients {
		wg.Go(func() {
			for s := range next {
				for turn := range s.calls {
					if err := a.call(ctx, p.target, s.rollout, s.id, turn); err != nil {
						mu.Lock()
						failed++
						mu.Unlock()
						break
					}
				}
				mu.Lock()
				left[s.rollout]--
				done := left[s.rollout] == 0
				mu.Unlock()
				if done {
					p.ended(s.rollout)
				}
			}
		})
	}
	for _, s := range samples {
		select {
		case next <- s:
		case <-ctx.Done():
		}
	}
	close(next)
	wg.Wait()
	return failed
}

// measureBalance runs long and short samples over 8 engines: one sample
// in ten makes LongCalls calls, the others 2. The plane is told when each
// rollout ends, as the rollout service tells it.
func measureBalance(ctx context.Context, cfg Config) (Balance, error) {
	b := Balance{Engines: 8, Samples: cfg.Samples}
	f, err := startFleet(b.Engines, nil)
	if err != nil {
		return b, err
	}
	defer f.close()
	p, skipped, err := plane(ctx, cfg, f, dropCalls)
	if err != nil || skipped != "" {
		b.Skipped = skipped
		return b, err
	}
	defer p.stop()
	samples := make([]sample, cfg.Samples)
	for i := range samples {
		samples[i] = sample{rollout: fmt.Sprintf("r%d", i/4), id: fmt.Sprintf("s%d", i%4), calls: 2}
		if i%10 == 0 {
			samples[i].calls = cfg.LongCalls
		}
		b.Calls += samples[i].calls
	}
	a := newAgent(cfg.SkewClients)
	defer a.client.CloseIdleConnections()
	if failed := runSamples(ctx, a, p, cfg.SkewClients, samples); failed > 0 {
		return b, fmt.Errorf("planebench: %d samples of the skewed run failed with every engine healthy", failed)
	}
	b.Affinity, b.MaxMean = f.affinity()
	return b, ctx.Err()
}

// affinity is the fraction of answers that came from their sample's most
// used engine, and the busiest engine's answers over the mean.
func (f *fleet) affinity() (affinity, maxMean float64) {
	perSample := map[string][]int{}
	total, busiest := 0, 0
	for i, e := range f.engines {
		e.mu.Lock()
		for k, n := range e.answered {
			if perSample[k] == nil {
				perSample[k] = make([]int, len(f.engines))
			}
			perSample[k][i] += n
		}
		total += e.calls
		busiest = max(busiest, e.calls)
		e.mu.Unlock()
	}
	if total == 0 {
		return 0, 0
	}
	onMain := 0
	for _, counts := range perSample {
		m := 0
		for _, n := range counts {
			m = max(m, n)
		}
		onMain += m
	}
	return float64(onMain) / float64(total), float64(busiest) * float64(len(f.engines)) / float64(total)
}

// answers counts the recorded calls that were answered, per sample.
type answers struct {
	mu sync.Mutex
	ok map[string]int
}

func (r *answers) RecordCall(_ context.Context, c *osmo.LLMCall) {
	if c.StatusCode != http.StatusOK || c.Error != "" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ok == nil {
		r.ok = map[string]int{}
	}
	r.ok[c.RolloutID+"/"+c.SampleID]++
}

// killCalls is how many calls each rollout of the kill run makes.
const killCalls = 3

// measureKill runs cfg.Rollouts rollouts of one sample on cfg.KillEngines
// engines; engine 0 dies half way through its share of the calls, its
// port closing and its connections cut.
func measureKill(ctx context.Context, cfg Config) (Kill, error) {
	k := Kill{Engines: cfg.KillEngines, Rollouts: cfg.Rollouts, Calls: cfg.Rollouts * killCalls}
	dieAt := max(k.Calls/k.Engines/2, 1)
	f, err := startFleet(k.Engines, map[int]mockllm.Options{0: {DieAfter: dieAt, Latency: time.Millisecond}})
	if err != nil {
		return k, err
	}
	defer f.close()
	var rec answers
	p, skipped, err := plane(ctx, cfg, f, &rec)
	if err != nil || skipped != "" {
		k.Skipped = skipped
		return k, err
	}
	defer p.stop()
	samples := make([]sample, k.Rollouts)
	for i := range samples {
		samples[i] = sample{rollout: fmt.Sprintf("k%d", i), id: "s0", calls: killCalls}
	}
	a := newAgent(64)
	defer a.client.CloseIdleConnections()
	got := map[string]int{}
	var mu sync.Mutex
	a.answered = func(key string) { mu.Lock(); got[key]++; mu.Unlock() }
	k.Lost = runSamples(ctx, a, p, 64, samples)
	engines := 0
	for _, e := range f.engines {
		e.mu.Lock()
		engines += e.calls
		e.mu.Unlock()
	}
	rec.mu.Lock()
	recorded := 0
	for key, n := range rec.ok {
		recorded += n
		k.Twice += max(n-got[key], 0)
	}
	rec.mu.Unlock()
	k.Unsent = max(engines-recorded, 0)
	k.Cut = max(int(f.engines[0].mock.Requests())-dieAt+1, 0)
	return k, ctx.Err()
}

// WriteTable prints the report as osmo bench prints it.
func (r Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "policy plane: engines are mock policies on loopback, in this process (GOMAXPROCS=%d)\n", r.GOMAXPROCS)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "setup\tengines\tp50\tp99\tadded p99\treq/s\t")
	var skipped []Setup
	for _, s := range []Setup{r.Direct, r.Single, r.Plane1, r.Plane8} {
		if s.Skipped != "" {
			skipped = append(skipped, s)
			continue
		}
		added := "-"
		if s.Name != r.Direct.Name {
			added = us(r.AddedP99(s))
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%.0f\t\n", s.Name, s.Engines, us(s.P50), us(s.P99), added, s.PerSecond)
	}
	_ = tw.Flush()
	for _, s := range skipped {
		fmt.Fprintf(w, "%s with %d engines: skipped: %s\n", s.Name, s.Engines, s.Skipped)
	}
	if ratio := r.AddedP99Ratio(); ratio > 0 {
		fmt.Fprintf(w, "plane (8 engines) added p99 / single upstream added p99: %.2f (target <= 1.2)\n", ratio)
		if r.Single.PerSecond > 0 {
			fmt.Fprintf(w, "plane (8 engines) req/s / single upstream req/s: %.2f\n", r.Plane8.PerSecond/r.Single.PerSecond)
		}
	}
	if r.Balance.Skipped != "" {
		fmt.Fprintf(w, "affinity and balance: skipped: %s\n", r.Balance.Skipped)
	} else {
		fmt.Fprintf(w, "affinity: %.2f%% of %d calls of %d samples (1 in 10 long) on their sample's engine, %d engines (target >= 99%%)\n",
			100*r.Balance.Affinity, r.Balance.Calls, r.Balance.Samples, r.Balance.Engines)
		fmt.Fprintf(w, "balance: busiest engine / mean engine calls: %.2f (target <= 1.3)\n", r.Balance.MaxMean)
	}
	if r.Kill.Skipped != "" {
		fmt.Fprintf(w, "engine killed mid-run: skipped: %s\n", r.Kill.Skipped)
	} else {
		fmt.Fprintf(w, "engine killed mid-run: %d rollouts of %d calls on %d engines, %d calls cut, %d answers unsent: %d lost, %d answered twice (target 0, 0)\n",
			r.Kill.Rollouts, killCalls, r.Kill.Engines, r.Kill.Cut, r.Kill.Unsent, r.Kill.Lost, r.Kill.Twice)
	}
}

func us(d time.Duration) string { return fmt.Sprintf("%dµs", d.Microseconds()) }
