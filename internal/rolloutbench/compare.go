package rolloutbench

import (
	"context"
	"fmt"
	"io"
	"math"
	"os/exec"
	"slices"
)

// Comparison is this build's `osmo serve` against another build's, under
// the same load, in alternating rounds so that whatever else the machine
// does falls on both alike.
type Comparison struct {
	// Baseline names the other build (its path).
	Baseline              string
	Rollouts, Concurrency int
	// InFlight rollouts were held at once in each run (none when 0).
	InFlight int
	// Current and Base hold one run per round, in round order.
	Current, Base []Run
}

// Run is one server's run in a comparison.
type Run struct {
	// Timed is the timed rollouts, with what they cost the server.
	Timed
	// HeldRSS, HeldAnon and PeakRSS are Report's, the first its Held.RSS;
	// NaN when none were held.
	HeldRSS, HeldAnon, PeakRSS float64
	GradeErr                   string
}

// Compare runs cfg.Serve's server and baseline's, rounds times each,
// alternating which goes first. Each run is a fresh server: a warm-up of
// cfg.Concurrency rollouts, cfg.Rollouts timed, then cfg.InFlight held
// at once for its RSS. The baseline is only asked to serve G2 with the
// flags every osmo since the rollout table's first version takes.
func Compare(ctx context.Context, cfg Config, baseline string, serveBaseline func([]string) *exec.Cmd, rounds int) (*Comparison, error) {
	ctx, h, err := newHarness(ctx, cfg.Timeout)
	if err != nil {
		return nil, err
	}
	defer h.stop()
	c := &Comparison{Baseline: baseline, Rollouts: cfg.Rollouts, Concurrency: cfg.Concurrency, InFlight: cfg.InFlight}
	sides := []struct {
		name  string
		serve func([]string) *exec.Cmd
		runs  *[]Run
	}{{"current", cfg.Serve, &c.Current}, {"baseline", serveBaseline, &c.Base}}
	for round := range rounds {
		for i := range sides {
			side := sides[(i+round)%len(sides)]
			r, err := runServe(ctx, h, cfg, side.serve, fmt.Sprintf("%s-%d", side.name, round))
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", side.name, round+1, err)
			}
			*side.runs = append(*side.runs, r)
		}
	}
	return c, nil
}

// runServe starts a server, warms it up, times cfg.Rollouts rollouts (ids
// prefixed by prefix), holds cfg.InFlight, and stops it.
func runServe(ctx context.Context, h *harness, cfg Config, serve func([]string) *exec.Cmd, prefix string) (Run, error) {
	r := Run{HeldRSS: math.NaN(), HeldAnon: math.NaN(), PeakRSS: math.NaN()}
	srv, base, err := startServe(ctx, cfg, serve)
	if err != nil {
		return r, err
	}
	defer srv.Stop(serveGrace)
	b := h.bench(base)
	if _, err := b.timed(ctx, prefix+"-warm", cfg.Concurrency, cfg.Concurrency); err != nil {
		return r, fmt.Errorf("%w (server output: %s)", err, srv.Output())
	}
	if r.Timed, err = b.timedUsage(ctx, srv, prefix, cfg.Rollouts, cfg.Concurrency); err != nil {
		return r, fmt.Errorf("%w (server output: %s)", err, srv.Output())
	}
	if cfg.InFlight <= 0 {
		return r, nil
	}
	m, err := h.hold(ctx, b, srv, prefix+"-held", cfg.InFlight, cfg.slots(), nil)
	r.HeldRSS, r.HeldAnon, r.PeakRSS, r.GradeErr = m.rss, m.anon, m.peak, m.gradeErr
	return r, err
}

// median is the median of runs by f, NaN when any is unknown.
func median(runs []Run, f func(Run) float64) float64 {
	v := make([]float64, len(runs))
	for i, r := range runs {
		v[i] = f(r)
		if math.IsNaN(v[i]) {
			return math.NaN()
		}
	}
	slices.Sort(v)
	if len(v) == 0 {
		return math.NaN()
	}
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// Ratio is this build's median of f over the baseline's: above 1 is more.
// NaN when either is unknown.
func (c *Comparison) Ratio(f func(Run) float64) float64 {
	cur, base := median(c.Current, f), median(c.Base, f)
	if base == 0 {
		return math.NaN()
	}
	return cur / base
}

// Names of the comparison's rows.
const (
	RowCurrent  = "this osmo serve"
	RowBaseline = "baseline osmo serve"
)

// WriteTable prints every round, then the ratios of the medians.
func (c *Comparison) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "osmo serve against a baseline (%s): %d rounds, each a fresh server of either, alternately first; %d rollouts timed per run, %d at a time, after %d untimed",
		c.Baseline, len(c.Current), c.Rollouts, c.Concurrency, c.Concurrency)
	if c.InFlight > 0 {
		fmt.Fprintf(w, "; then %d held in their LLM call at once, and released", c.InFlight)
	}
	fmt.Fprintln(w)
	held := func(r Run) string { return "" }
	header := fmt.Sprintf("  %-22s %6s %10s %10s %10s %11s %12s %14s %15s", "", "round", "rollouts/s", "p50", "p99", "graded", "CPU/rollout", "alloc/rollout", "allocs/rollout")
	if c.InFlight > 0 {
		header += fmt.Sprintf(" %20s %16s %20s", fmt.Sprintf("RSS, %d held", c.InFlight), "of it anonymous", "peak RSS (VmHWM)")
		held = func(r Run) string {
			s := fmt.Sprintf(" %20s %16s %20s", mib(r.HeldRSS), mib(r.HeldAnon), mib(r.PeakRSS))
			if r.GradeErr != "" {
				s += "  not all graded: " + r.GradeErr
			}
			return s
		}
	}
	fmt.Fprintln(w, header)
	row := func(name string, round int, r Run) {
		fmt.Fprintf(w, "  %-22s %6d %10.0f %10s %10s %11s %12s %14s %15s%s\n", name, round, r.RolloutsPerSec, ms(r.P50), ms(r.P99),
			fmt.Sprintf("%d/%d", r.Graded, r.Rollouts), cpu(r.CPU), kib(r.AllocBytes), count(r.Allocs), held(r))
	}
	for i := range c.Current {
		row(RowCurrent, i+1, c.Current[i])
		if i < len(c.Base) {
			row(RowBaseline, i+1, c.Base[i])
		}
	}
	// x is the ratio of the medians of f, this build's over the baseline's.
	x := func(f func(Run) float64) string { return orNA("%.2fx", c.Ratio(f), 1) }
	fmt.Fprintf(w, "this osmo serve against the baseline, medians: rollouts/s %s, p50 %s, p99 %s, CPU/rollout %s, alloc/rollout %s, allocs/rollout %s",
		x(func(r Run) float64 { return r.RolloutsPerSec }), x(func(r Run) float64 { return float64(r.P50) }),
		x(func(r Run) float64 { return float64(r.P99) }), x(func(r Run) float64 { return r.CPU }),
		x(func(r Run) float64 { return r.AllocBytes }), x(func(r Run) float64 { return r.Allocs }))
	if c.InFlight > 0 {
		fmt.Fprintf(w, ", RSS with %d held %s, anonymous RSS with %d held %s, peak RSS %s",
			c.InFlight, x(func(r Run) float64 { return r.HeldRSS }),
			c.InFlight, x(func(r Run) float64 { return r.HeldAnon }),
			x(func(r Run) float64 { return r.PeakRSS }))
	}
	fmt.Fprintln(w)
	note := "(CPU/rollout: the server's user+system time over the timed run, /proc/PID/stat; alloc/rollout and allocs/rollout: bytes and objects its Go runtime allocated then, from its /metrics"
	if c.InFlight > 0 {
		note += "; RSS: VmRSS with the rollouts held, and of it RssAnon (the rest is mostly the executable's pages, as many as the page cache maps), VmHWM once all are graded, /proc/PID/status"
	}
	fmt.Fprintln(w, note+")")
}
