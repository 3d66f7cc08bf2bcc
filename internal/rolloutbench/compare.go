package rolloutbench

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"time"
)

// Comparison is this build's `osmo serve` against another build's, under
// the same load from the same harness, measured in alternating rounds so
// that whatever else the machine does falls on both alike.
type Comparison struct {
	// Baseline names the other build (its path).
	Baseline              string
	Rollouts, Concurrency int
	// Current and Base hold one timed run per round, in round order.
	Current, Base []Timed
}

// Compare times cfg.Serve's server and baseline's, rounds times each,
// alternating which goes first. Each run is a fresh server: a warm-up of
// cfg.Concurrency rollouts, untimed, then cfg.Rollouts timed, cfg.Concurrency
// at a time. The baseline is only asked to serve G2 with the flags every
// osmo since the rollout table's first version takes; state and memory
// figures are not compared.
func Compare(ctx context.Context, cfg Config, baseline string, serveBaseline func([]string) *exec.Cmd, rounds int) (*Comparison, error) {
	// No rollouts are held: the servers' limits need room only for the
	// timed ones.
	cfg.InFlight = 0
	return withHarness(ctx, cfg.Timeout, func(ctx context.Context, h *harness) (*Comparison, error) {
		c := &Comparison{Baseline: baseline, Rollouts: cfg.Rollouts, Concurrency: cfg.Concurrency}
		sides := []struct {
			name  string
			serve func([]string) *exec.Cmd
			runs  *[]Timed
		}{{"current", cfg.Serve, &c.Current}, {"baseline", serveBaseline, &c.Base}}
		for round := range rounds {
			for i := range sides {
				side := sides[(i+round)%len(sides)]
				t, err := timeServe(ctx, h, cfg, side.serve, fmt.Sprintf("%s-%d", side.name, round))
				if err != nil {
					return nil, fmt.Errorf("%s, round %d: %w", side.name, round+1, err)
				}
				*side.runs = append(*side.runs, t)
			}
		}
		return c, nil
	})
}

// timeServe starts a server, warms it up, times cfg.Rollouts rollouts
// (ids prefixed by prefix) and stops it.
func timeServe(ctx context.Context, h *harness, cfg Config, serve func([]string) *exec.Cmd, prefix string) (Timed, error) {
	srv, base, err := startServe(ctx, cfg, serve)
	if err != nil {
		return Timed{}, err
	}
	defer srv.stop(5 * time.Second)
	b := h.bench(base)
	if _, err := b.timed(ctx, prefix+"-warm", cfg.Concurrency, cfg.Concurrency); err != nil {
		return Timed{}, fmt.Errorf("%w (server output: %s)", err, srv.out.String())
	}
	t, err := b.timed(ctx, prefix, cfg.Rollouts, cfg.Concurrency)
	if err != nil {
		return Timed{}, fmt.Errorf("%w (server output: %s)", err, srv.out.String())
	}
	return t, nil
}

// median is the median of runs by f.
func median(runs []Timed, f func(Timed) float64) float64 {
	v := make([]float64, len(runs))
	for i, t := range runs {
		v[i] = f(t)
	}
	slices.Sort(v)
	if len(v) == 0 {
		return 0
	}
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// Ratios are this build's medians over the baseline's: rollouts/s (above
// 1 is faster), p50 and p99 (below 1 is faster).
func (c *Comparison) Ratios() (perSec, p50, p99 float64) {
	ratio := func(f func(Timed) float64) float64 {
		return median(c.Current, f) / max(median(c.Base, f), 1e-9)
	}
	return ratio(func(t Timed) float64 { return t.RolloutsPerSec }),
		ratio(func(t Timed) float64 { return float64(t.P50) }),
		ratio(func(t Timed) float64 { return float64(t.P99) })
}

// Names of the comparison's rows.
const (
	RowCurrent  = "this osmo serve"
	RowBaseline = "baseline osmo serve"
)

// WriteTable prints every round, then the ratios of the medians.
func (c *Comparison) WriteTable(w io.Writer) {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }
	fmt.Fprintf(w, "osmo serve against a baseline (%s): %d rounds, each a fresh server of either, alternately first; %d rollouts timed per run, %d at a time, after %d untimed\n",
		c.Baseline, len(c.Current), c.Rollouts, c.Concurrency, c.Concurrency)
	fmt.Fprintf(w, "  %-22s %6s %10s %10s %10s %11s\n", "", "round", "rollouts/s", "p50", "p99", "graded")
	row := func(name string, round int, t Timed) {
		fmt.Fprintf(w, "  %-22s %6d %10.0f %10s %10s %11s\n", name, round, t.RolloutsPerSec, ms(t.P50), ms(t.P99), fmt.Sprintf("%d/%d", t.Graded, t.Rollouts))
	}
	for i := range c.Current {
		row(RowCurrent, i+1, c.Current[i])
		if i < len(c.Base) {
			row(RowBaseline, i+1, c.Base[i])
		}
	}
	perSec, p50, p99 := c.Ratios()
	fmt.Fprintf(w, "this osmo serve against the baseline, medians: rollouts/s %.2fx, p50 %.2fx, p99 %.2fx\n", perSec, p50, p99)
}
