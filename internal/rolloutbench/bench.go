// Package rolloutbench measures `osmo serve` end to end: G2 rollouts per
// second and their latency, what a rollout costs the server in memory and
// descriptors while it waits on the policy and once it is a finished
// record, and what it writes to the shared state; and the same throughput
// and state figures for a cluster (three `osmo rollout` replicas behind
// `osmo gateway`, over three NATS nodes). Servers run as processes of their
// own; the trainer and the policy double run in this one, on loopback.
package rolloutbench

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/osmo-rl/osmo/internal/benchproc"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/procstat"
)

// Config says what to measure.
type Config struct {
	// Serve builds the command that runs `osmo serve ARGS`.
	Serve func(args []string) *exec.Cmd
	// Rollouts run for the throughput figures, Concurrency at a time.
	Rollouts, Concurrency int
	// InFlight rollouts are held in their first LLM call at once for the
	// memory figures, then released and graded.
	InFlight int
	// MaxConcurrent, when set, is each server's --max-concurrent: fewer
	// slots than rollouts in flight make the rest wait in its queue. By
	// default every rollout in flight has a slot.
	MaxConcurrent int
	// Workflow is the workflow the server runs (multiply when empty).
	Workflow string
	// StateDir, when set, is the server's --state: its embedded NATS
	// server keeps the state in files there.
	StateDir string
	// StateSync is the server's --state-sync with StateDir ("" its default).
	StateSync string
	// Cluster, when set, measures the same load on a cluster too.
	Cluster *Cluster
	// Timeout bounds the whole measurement.
	Timeout time.Duration
}

// limit is each server's --max-queued, and its --max-concurrent unless
// MaxConcurrent is set: room for every rollout the bench has in flight at
// once, so none is refused (nor, by default, waits in a queue).
func (c *Config) limit() int { return max(c.InFlight, c.Concurrency) }

// slots is each server's --max-concurrent.
func (c *Config) slots() int { return cmp.Or(c.MaxConcurrent, c.limit()) }

// Report is what was measured.
type Report struct {
	// State says the server kept its state in files (--state).
	State       bool
	Concurrency int
	// Timed is `osmo serve`'s throughput run.
	Timed
	// Cluster is the same run on a cluster, when measured; else
	// ClusterSkipped may say why not.
	Cluster        *Timed
	ClusterSkipped string

	InFlight int
	// Base is the server before any rollout; Held with InFlight rollouts
	// held in their LLM call; Done once those are finished records.
	Base, Held, Done Sample
	// PeakRSS is the most the server was resident by the time every held
	// rollout was graded (VmHWM), HeldAnon the part of Held's RSS that is
	// its own memory (RssAnon; see procstat.Memory), in bytes. NaN where
	// /proc is not Linux's.
	PeakRSS, HeldAnon float64
	// AllGraded: every held rollout was graded once released; GradeErr
	// says what the first that was not got instead.
	AllGraded bool
	GradeErr  string
}

// Timed is one throughput run: Rollouts, each timed from its start to its
// grader callback, and what they wrote to the shared state.
type Timed struct {
	Rollouts int
	// Graded is how many rollouts' grader callbacks reported success.
	Graded         int
	RolloutsPerSec float64
	P50, P99       time.Duration
	// StateWrites and StateBytes are the writes to the shared state during
	// the run and their bytes, every replica's summed.
	StateWrites, StateBytes float64
	// CPU is the server's user and system time over the run, in seconds
	// per rollout; AllocBytes and Allocs what its Go runtime allocated,
	// bytes and objects per rollout. NaN where unknown, and for the cluster.
	CPU, AllocBytes, Allocs float64
}

// usage is what the server process pid, its /metrics at base, has spent
// so far: CPU seconds, and the bytes and objects its Go runtime allocated.
// NaN is unknown.
func usage(ctx context.Context, pid int, base string) (cpu, allocBytes, allocs float64, err error) {
	cpu, allocBytes, allocs = math.NaN(), math.NaN(), math.NaN()
	switch d, err := procstat.CPU(pid); {
	case err == nil:
		cpu = d.Seconds()
	case !errors.Is(err, procstat.ErrUnsupported):
		return cpu, allocBytes, allocs, fmt.Errorf("rolloutbench: %w", err)
	}
	err = scrape(ctx, base, map[string]*float64{"go_memstats_alloc_bytes_total": &allocBytes, "go_memstats_mallocs_total": &allocs})
	return cpu, allocBytes, allocs, err
}

// memory is process pid's VmRSS, RssAnon and VmHWM, in bytes; NaN for
// each where /proc is not Linux's or does not say.
func memory(pid int) (rss, anon, peak float64, err error) {
	m, err := procstat.Mem(pid)
	if errors.Is(err, procstat.ErrUnsupported) {
		return math.NaN(), math.NaN(), math.NaN(), nil
	}
	if err != nil {
		return 0, 0, 0, fmt.Errorf("rolloutbench: %w", err)
	}
	known := func(v uint64) float64 {
		if v == 0 {
			return math.NaN()
		}
		return float64(v)
	}
	return known(m.RSS), known(m.Anon), known(m.Peak), nil
}

// WritesPerRollout is the state's writes per rollout of the run.
func (t *Timed) WritesPerRollout() float64 { return t.StateWrites / float64(max(t.Rollouts, 1)) }

// BytesPerRollout is the bytes written to the state per rollout of the run.
func (t *Timed) BytesPerRollout() float64 { return t.StateBytes / float64(max(t.Rollouts, 1)) }

// Sample is the server's process as its /metrics reports it.
type Sample struct {
	RSS        float64 // bytes
	HeapInuse  float64 // bytes
	StackInuse float64 // bytes
	FDs        float64
	Goroutines float64
	// Records and RecordBytes are the finished records held and what
	// they hold, as the server counts them.
	Records, RecordBytes float64
}

// Measure runs the server, measures, and stops it; then, with
// cfg.Cluster, does the same on a cluster.
func Measure(ctx context.Context, cfg Config) (*Report, error) {
	ctx, h, err := newHarness(ctx, cfg.Timeout)
	if err != nil {
		return nil, err
	}
	defer h.stop()
	rep, err := measureServe(ctx, h, cfg)
	if err != nil {
		return nil, err
	}
	if cfg.Cluster != nil {
		if rep.Cluster, err = measureCluster(ctx, h, cfg); err != nil {
			return nil, fmt.Errorf("cluster: %w", err)
		}
	}
	return rep, nil
}

// harness is the measuring side: the policy double behind a gate and the
// G2 trainer double, until stop.
type harness struct {
	gate   *Gate
	policy *httptest.Server
	ctl    *controller.G2
	stop   func()
}

// newHarness starts the harness, and returns ctx bounded by timeout.
func newHarness(ctx context.Context, timeout time.Duration) (context.Context, *harness, error) {
	gate := NewGate()
	mock, err := mockllm.New(mockllm.Options{Logger: quiet()})
	if err != nil {
		return nil, nil, err
	}
	policy := httptest.NewServer(gate.Wrap(mock))
	ctl, err := controller.NewG2("127.0.0.1:0", controller.G2Options{PolicyURL: policy.URL + "/v1", APIKey: "bench-key", Logger: quiet()})
	if err != nil {
		policy.Close()
		return nil, nil, err
	}
	ctlCtx, stopCtl := context.WithCancel(context.WithoutCancel(ctx))
	ctlDone := make(chan struct{})
	go func() { defer close(ctlDone); _ = ctl.Serve(ctlCtx) }()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	stop := func() { cancel(); stopCtl(); <-ctlDone; policy.Close() }
	return ctx, &harness{gate: gate, policy: policy, ctl: ctl, stop: stop}, nil
}

// bench posts to the rollout service at base.
func (h *harness) bench(base string) *bench {
	return &bench{ctl: h.ctl, base: base, policy: h.policy.URL + "/v1"}
}

// serveGrace is how long a measured osmo serve has to stop before it is
// killed: killed, it would leave its embedded NATS server's directory.
const serveGrace = 10 * time.Second

// measureServe measures `osmo serve`, and stops it.
func measureServe(ctx context.Context, h *harness, cfg Config) (*Report, error) {
	srv, base, err := startServe(ctx, cfg, cfg.Serve)
	if err != nil {
		return nil, err
	}
	defer srv.Stop(serveGrace)

	b := h.bench(base)
	rep := &Report{Concurrency: cfg.Concurrency, InFlight: cfg.InFlight, State: cfg.StateDir != ""}
	if rep.Base, err = Scrape(ctx, base); err != nil {
		return nil, err
	}

	m, err := h.hold(ctx, b, srv, "held", cfg.InFlight, cfg.slots(), func() (err error) {
		rep.Held, err = Scrape(ctx, base)
		return err
	})
	if err != nil {
		return nil, err
	}
	rep.HeldAnon, rep.PeakRSS, rep.GradeErr, rep.AllGraded = m.anon, m.peak, m.gradeErr, m.gradeErr == ""

	// Throughput: Rollouts more, Concurrency at a time. The held
	// rollouts' last writes (their lifecycles finished once their
	// callbacks are delivered) trail their grader callbacks: the state's
	// counters are read once they stop moving, before and after.
	before, err := settledState(ctx, []string{base})
	if err != nil {
		return nil, err
	}
	if rep.Timed, err = b.timedUsage(ctx, srv, "run", cfg.Rollouts, cfg.Concurrency); err != nil {
		return nil, err
	}
	after, err := settledState(ctx, []string{base})
	if err != nil {
		return nil, err
	}
	rep.StateWrites, rep.StateBytes = after.writes-before.writes, after.bytes-before.bytes
	if rep.Done, err = Scrape(ctx, base); err != nil {
		return nil, err
	}
	return rep, nil
}

// heldMemory is the server's memory in bytes while rollouts were held
// (VmRSS, RssAnon) and its peak once they were graded (VmHWM); gradeErr
// says what the first rollout that was not graded got instead.
type heldMemory struct {
	rss, anon, peak float64
	gradeErr        string
}

// hold holds n rollouts (ids prefix-00000 on) at once, as many as the
// server has slots for in their first LLM call and the rest queued, calls
// atHeld (when set) and reads the memory, then lets the policy answer and
// waits until every one is graded.
func (h *harness) hold(ctx context.Context, b *bench, srv *benchproc.Proc, prefix string, n, slots int, atHeld func() error) (m heldMemory, err error) {
	h.gate.Close()
	defer h.gate.Open()
	held := make([]string, n)
	for i := range held {
		held[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(64)
	for _, id := range held {
		g.Go(func() error { return b.post(gctx, id) })
	}
	if err := g.Wait(); err != nil {
		return m, err
	}
	// With fewer slots than n (Config.MaxConcurrent), the rest wait in
	// the server's queue, admitted: they are held too.
	if err := h.gate.WaitParked(ctx, min(n, slots)); err != nil {
		return m, fmt.Errorf("rolloutbench: %w (server output: %s)", err, srv.Output())
	}
	if atHeld != nil {
		if err := atHeld(); err != nil {
			return m, err
		}
	}
	if m.rss, m.anon, _, err = memory(srv.PID()); err != nil {
		return m, err
	}
	h.gate.Open()
	for _, id := range held {
		res, err := b.ctl.WaitGrader(ctx, id)
		if err == nil && res.Status != "success" {
			err = fmt.Errorf("%s: %s", id, res.Raw)
		}
		if err != nil {
			m.gradeErr = err.Error()
			break
		}
	}
	_, _, m.peak, err = memory(srv.PID())
	return m, err
}

// startServe starts the `osmo serve` that serve builds, with cfg's
// workflow, limits and state, and waits until it is healthy; its caller
// stops it. base is its URL.
//
// The port is one nothing listened on a moment before, which a connection
// of the machine may take as its own end in between (after a run that held
// 10,000 connections, ephemeral ports are many): a server that could not
// bind it is started again on another, up to three times.
func startServe(ctx context.Context, cfg Config, serve func([]string) *exec.Cmd) (srv *benchproc.Proc, base string, err error) {
	args := []string{"--workflow", cmp.Or(cfg.Workflow, "multiply"), "-H", "127.0.0.1",
		"--max-concurrent", strconv.Itoa(cfg.slots()), "--max-queued", strconv.Itoa(cfg.limit()), "--log-level", "error"}
	if cfg.StateDir != "" {
		args = append(args, "--state", cfg.StateDir)
		if cfg.StateSync != "" {
			args = append(args, "--state-sync", cfg.StateSync)
		}
	}
	for try := 1; ; try++ {
		addr, err := benchproc.FreeAddr()
		if err != nil {
			return nil, "", err
		}
		cmd := serve(slices.Concat(args, []string{"-p", portOf(addr)}))
		// Every held rollout keeps its upstream connection open.
		if cmd.Env == nil {
			cmd.Env = os.Environ()
		}
		cmd.Env = append(cmd.Env, "OSMOSIS_ROLLOUT_CLIENT_MAX_CONNECTIONS="+strconv.Itoa(cfg.InFlight+cfg.Concurrency))
		if srv, err = benchproc.Start("osmo serve", cmd, (*exec.Cmd).Start); err != nil {
			return nil, "", fmt.Errorf("rolloutbench: %w", err)
		}
		base = "http://" + addr
		err = srv.WaitHTTP(ctx, base+"/health", http.StatusOK)
		if err == nil {
			return srv, base, nil
		}
		srv.Stop(serveGrace)
		if try == 3 || !strings.Contains(err.Error(), "address already in use") {
			return nil, "", fmt.Errorf("rolloutbench: %w", err)
		}
	}
}

type bench struct {
	ctl    *controller.G2
	base   string
	policy string
}

// post starts one G2 rollout whose LLM calls go straight to the policy
// double (the controller relaying them would double the descriptors of
// the measuring process).
func (b *bench) post(ctx context.Context, id string) error {
	body := b.ctl.StartBody(id, []map[string]any{{"role": "user", "content": "What is 6 times 7?"}})
	body["chat_completions_url"] = b.policy
	body["label"] = "42"
	body["agent_timeout_sec"] = 3600
	for {
		code, _, data, err := b.ctl.Start(ctx, b.base, "", body)
		switch {
		case err != nil:
			return err
		case code == http.StatusAccepted:
			return nil
		case code != http.StatusTooManyRequests:
			return fmt.Errorf("start %s: %d %s", id, code, data)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// timedUsage is timed, with what the server process srv spent over the
// run per rollout.
func (b *bench) timedUsage(ctx context.Context, srv *benchproc.Proc, prefix string, n, concurrency int) (Timed, error) {
	cpu, allocBytes, allocs, err := usage(ctx, srv.PID(), b.base)
	if err != nil {
		return Timed{}, err
	}
	t, err := b.timed(ctx, prefix, n, concurrency)
	if err != nil {
		return Timed{}, err
	}
	cpu2, allocBytes2, allocs2, err := usage(ctx, srv.PID(), b.base)
	if err != nil {
		return Timed{}, err
	}
	per := float64(max(t.Rollouts, 1))
	t.CPU, t.AllocBytes, t.Allocs = (cpu2-cpu)/per, (allocBytes2-allocBytes)/per, (allocs2-allocs)/per
	return t, nil
}

// timed runs n rollouts (ids prefix-00000 on), concurrency at a time,
// each timed from its start to its grader callback.
func (b *bench) timed(ctx context.Context, prefix string, n, concurrency int) (Timed, error) {
	lat := make([]time.Duration, n)
	var graded atomic.Int64
	began := time.Now()
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(concurrency)
	for i := range n {
		id := fmt.Sprintf("%s-%05d", prefix, i)
		g.Go(func() error {
			t0 := time.Now()
			if err := b.post(gctx, id); err != nil {
				return err
			}
			res, err := b.ctl.WaitGrader(gctx, id)
			if err != nil {
				return err
			}
			lat[i] = time.Since(t0)
			if res.Status == "success" {
				graded.Add(1)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return Timed{}, fmt.Errorf("rolloutbench: %w", err)
	}
	t := Timed{Rollouts: n, Graded: int(graded.Load()), RolloutsPerSec: float64(n) / time.Since(began).Seconds(),
		CPU: math.NaN(), AllocBytes: math.NaN(), Allocs: math.NaN()}
	slices.Sort(lat)
	t.P50, t.P99 = lat[len(lat)/2], lat[len(lat)*99/100]
	return t, nil
}

// Gate holds the requests of the handler it wraps while closed, counting
// them: a policy that has not answered yet.
type Gate struct {
	mu     sync.Mutex
	opened chan struct{} // closed by Open; nil while the gate is open
	parked atomic.Int64
}

// NewGate returns an open gate.
func NewGate() *Gate { return &Gate{} }

// Close holds requests from now on.
func (g *Gate) Close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.opened == nil {
		g.opened = make(chan struct{})
	}
}

// Open lets held requests and new ones through.
func (g *Gate) Open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.opened != nil {
		close(g.opened)
		g.opened = nil
	}
}

// Wrap is h behind the gate. A held request whose client goes away is
// answered by nobody, as a policy's would be.
func (g *Gate) Wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.mu.Lock()
		opened := g.opened
		g.mu.Unlock()
		if opened != nil {
			// Read first, as a policy does before it generates: the
			// server notices a client that goes away only once the body
			// is read.
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(body))
			g.parked.Add(1)
			select {
			case <-opened:
			case <-r.Context().Done():
				g.parked.Add(-1)
				return
			}
			g.parked.Add(-1)
		}
		h.ServeHTTP(w, r)
	})
}

// Parked is the number of requests held now.
func (g *Gate) Parked() int { return int(g.parked.Load()) }

// WaitParked waits until n requests are held, and a little more so the
// server holding them has settled.
func (g *Gate) WaitParked(ctx context.Context, n int) error {
	for g.parked.Load() < int64(n) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("only %d of %d rollouts reached the policy: %w", g.parked.Load(), n, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	// Let the server settle (its allocations for the held calls done).
	time.Sleep(500 * time.Millisecond)
	return nil
}

// Scrape reads a server's process figures from its /metrics.
func Scrape(ctx context.Context, base string) (Sample, error) {
	var s Sample
	err := scrape(ctx, base, map[string]*float64{
		"process_resident_memory_bytes": &s.RSS,
		"go_memstats_heap_inuse_bytes":  &s.HeapInuse,
		"go_memstats_stack_inuse_bytes": &s.StackInuse,
		"process_open_fds":              &s.FDs,
		"go_goroutines":                 &s.Goroutines,
		"osmo_rollout_records":          &s.Records,
		"osmo_rollout_records_bytes":    &s.RecordBytes,
	})
	if err == nil && s.RSS == 0 {
		return s, errors.New("rolloutbench: /metrics has no process_resident_memory_bytes (not Linux?)")
	}
	return s, err
}

// scrape reads the unlabeled metrics named in want from base's /metrics.
func scrape(ctx context.Context, base string, want map[string]*float64) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("rolloutbench: /metrics: %w", err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if dst := want[name]; ok && dst != nil {
			*dst, _ = strconv.ParseFloat(value, 64)
		}
	}
	return sc.Err()
}

// stateCount is what the rollout services at some bases have written to
// the shared state so far, summed.
type stateCount struct{ writes, bytes float64 }

// settledState reads the state's counters of every base until two reads
// 300 ms apart agree, for at most 10 s: a rollout's last write (its
// lifecycle finished) follows the grader callback that ends its timing.
func settledState(ctx context.Context, bases []string) (stateCount, error) {
	var last stateCount
	deadline := time.Now().Add(10 * time.Second)
	for first := true; ; first = false {
		var now stateCount
		for _, base := range bases {
			var w, b float64 = -1, -1
			if err := scrape(ctx, base, map[string]*float64{"osmo_state_writes_total": &w, "osmo_state_write_bytes_total": &b}); err != nil {
				return now, err
			}
			if w < 0 || b < 0 {
				return now, fmt.Errorf("rolloutbench: %s/metrics has no osmo_state_writes_total or osmo_state_write_bytes_total", base)
			}
			now.writes, now.bytes = now.writes+w, now.bytes+b
		}
		if (!first && now == last) || time.Now().After(deadline) {
			return now, nil
		}
		last = now
		select {
		case <-ctx.Done():
			return now, ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// PerRollout is the server's extra resident memory per held rollout.
func (r *Report) PerRollout() float64 { return (r.Held.RSS - r.Base.RSS) / float64(max(r.InFlight, 1)) }

// PerRecord is the server's extra heap per finished record, once every
// rollout of the run is one.
func (r *Report) PerRecord() float64 {
	return (r.Done.HeapInuse - r.Base.HeapInuse) / float64(max(r.InFlight+r.Rollouts, 1))
}

// Names of the rows of the throughput table.
const (
	RowEmbedded = "embedded (osmo serve)"
	RowCluster  = "cluster (3 rollout replicas, 3 NATS nodes)"
)

// WriteTable prints the report.
func (r *Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "Rollouts end to end (G2 trainer and policy double on loopback in this process; %d rollouts, %d at a time, each timed from its start to its grader callback)\n",
		r.Rollouts, r.Concurrency)
	fmt.Fprintf(w, "  %-44s %10s %10s %10s %11s %14s %14s %12s %14s %15s\n", "", "rollouts/s", "p50", "p99", "graded", "state writes", "state bytes",
		"CPU/rollout", "alloc/rollout", "allocs/rollout")
	row := func(name string, t *Timed) {
		fmt.Fprintf(w, "  %-44s %10.0f %10s %10s %11s %14.1f %14s %12s %14s %15s\n", name, t.RolloutsPerSec, ms(t.P50), ms(t.P99),
			fmt.Sprintf("%d/%d", t.Graded, t.Rollouts), t.WritesPerRollout(), kib(t.BytesPerRollout()),
			cpu(t.CPU), kib(t.AllocBytes), count(t.Allocs))
	}
	row(RowEmbedded, &r.Timed)
	switch {
	case r.Cluster != nil:
		row(RowCluster, r.Cluster)
	case r.ClusterSkipped != "":
		fmt.Fprintf(w, "  cluster: skipped: %s\n", r.ClusterSkipped)
	}
	state := "in memory"
	if r.State {
		state = "in files (--state)"
	}
	fmt.Fprintf(w, "  (state writes and bytes: per rollout, every replica's summed; embedded: its NATS server's state %s; cluster: JetStream files, 3 copies)\n", state)
	fmt.Fprintf(w, "  (CPU/rollout: osmo serve's user+system time over the timed run, /proc/PID/stat; alloc/rollout and allocs/rollout: bytes and objects its Go runtime allocated, go_memstats_alloc_bytes_total and go_memstats_mallocs_total on its /metrics; n/a for the cluster)\n")
	graded := fmt.Sprint(r.AllGraded)
	if r.GradeErr != "" {
		graded += " (" + r.GradeErr + ")"
	}
	each := func(a, b float64) string { return kib((a - b) / float64(max(r.InFlight, 1))) }
	fmt.Fprintf(w, "  osmo serve, %d in flight   RSS %s (anonymous %s; +%s each: heap %s, stacks %s), %.0f open files, %.0f goroutines; peak RSS %s while they finish (VmHWM); all graded when released: %s\n",
		r.InFlight, mib(r.Held.RSS), mib(r.HeldAnon), kib(r.PerRollout()), each(r.Held.HeapInuse, r.Base.HeapInuse), each(r.Held.StackInuse, r.Base.StackInuse),
		r.Held.FDs, r.Held.Goroutines, mib(r.PeakRSS), graded)
	fmt.Fprintf(w, "  osmo serve, %.0f finished records   %s held (%s each), heap in use %s (+%s each, garbage included), RSS %s\n",
		r.Done.Records, mib(r.Done.RecordBytes), kib(r.Done.RecordBytes/math.Max(r.Done.Records, 1)),
		mib(r.Done.HeapInuse), kib(math.Max(r.PerRecord(), 0)), mib(r.Done.RSS))
}

// orNA is v/unit in format, "n/a" when v is unknown.
func orNA(format string, v, unit float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "n/a"
	}
	return fmt.Sprintf(format, v/unit)
}

func kib(b float64) string { return orNA("%.1f KiB", b, 1<<10) }

func mib(b float64) string { return orNA("%.0f MiB", b, 1<<20) }

func ms(d time.Duration) string { return orNA("%.1f ms", float64(d), float64(time.Millisecond)) }

// cpu prints seconds as microseconds.
func cpu(sec float64) string { return orNA("%.0f µs", sec, 1e-6) }

func count(n float64) string { return orNA("%.0f", n, 1) }

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }
