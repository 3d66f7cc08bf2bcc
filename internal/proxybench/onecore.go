package proxybench

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/benchproc"
	"github.com/osmo-rl/osmo/internal/procstat"
)

// OneCoreConfig says how MeasureOneCore runs the proxy and loads it.
type OneCoreConfig struct {
	// Command returns the command that runs `osmo llmproxy` with args, its
	// flags. Its Env (nil: this process's) loses every OTEL_*,
	// OSMO_TRACE_CONTENT and GOMAXPROCS variable. Nil skips the measurement.
	Command func(args []string) *exec.Cmd
	// ReverseProxyCommand runs the process compared with it, a plain
	// httputil.ReverseProxy (ServeReverseProxy) taking the same --addr and
	// --upstream flags. Nil leaves the comparison out.
	ReverseProxyCommand func(args []string) *exec.Cmd
	// Requests is the number of timed requests per setup, sent in Rounds
	// rounds by Clients concurrent clients.
	Requests int
	Rounds   int
	Clients  int
}

// OneCoreSetup is one proxy process's measurement.
type OneCoreSetup struct {
	// Name is "off", "tracing", "reverseproxy" or "direct" (the clients
	// calling the upstream themselves, with no process: the floor the
	// others' latency is measured from).
	Name string
	// PID is the proxy process's id (exited when MeasureOneCore returns).
	PID int
	// Requests are timed, Warmup untimed ones sent before.
	Requests, Warmup int
	// Wall is the time the timed requests took, CPU the proxy process's
	// user and system time over the same rounds.
	Wall, CPU time.Duration
	// Spans is the number of spans the sink received from this process
	// over its whole life.
	Spans int64
	// Latency is the timed requests' as the clients saw it.
	Latency Latency

	latencies []time.Duration
}

// Throughput is the requests per second this setup served, wall clock.
func (s OneCoreSetup) Throughput() float64 { return ratio(float64(s.Requests), s.Wall.Seconds()) }

// CPUPerRequest is the proxy's CPU time per request in microseconds.
func (s OneCoreSetup) CPUPerRequest() float64 {
	return ratio(float64(s.CPU)/float64(time.Microsecond), float64(s.Requests))
}

// Capacity is the requests per second the proxy would serve with its one
// core fully busy: 1e6 / CPUPerRequest.
func (s OneCoreSetup) Capacity() float64 { return ratio(1e6, s.CPUPerRequest()) }

// Busy is the share of its core the proxy used during the timed rounds.
func (s OneCoreSetup) Busy() float64 { return ratio(float64(s.CPU), float64(s.Wall)) }

// OneCoreReport measures the standalone proxy process, alone on one core,
// with tracing off and on: its CPU time per request and what that makes of
// one core.
type OneCoreReport struct {
	// Skipped says why nothing was measured.
	Skipped string
	// Off runs without tracing; Tracing exports every call's span.
	Off     OneCoreSetup
	Tracing OneCoreSetup
	// ReverseProxy is a plain httputil.ReverseProxy process run alike (Name
	// "" when not measured), Direct the load sent straight to the upstream.
	ReverseProxy OneCoreSetup
	Direct       OneCoreSetup
	Clients      int
	Rounds       int
	// ProxyCPU is the CPU the proxy processes were pinned to; BenchCPUs
	// are those left to this process (with one CPU, that one).
	ProxyCPU  int
	BenchCPUs []int
	// GOGC is the GOGC in the proxies' environment ("" when unset).
	GOGC string
	// Warnings are irregularities that make the figures less trustworthy.
	Warnings []string
}

// TracingCPURatio is the tracing setup's CPU per request over the off
// setup's: 1.10 means tracing costs 10% more CPU per call (and 1/1.10 of
// the capacity on one core). Like every ratio of the report, it is 0 when
// either side was not measured.
func (r OneCoreReport) TracingCPURatio() float64 {
	return ratio(r.Tracing.CPUPerRequest(), r.Off.CPUPerRequest())
}

// TracingThroughputRatio is the tracing setup's wall-clock requests per
// second over the off setup's.
func (r OneCoreReport) TracingThroughputRatio() float64 {
	return ratio(r.Tracing.Throughput(), r.Off.Throughput())
}

// AddedP99Ratio is the p99 the proxy (tracing off) adds to a call, over
// Direct's, divided by the p99 the plain reverse proxy adds: 1.5 means the
// proxy's tail is half as long again as ReverseProxy's. It is 0 when the
// reverse proxy added nothing.
func (r OneCoreReport) AddedP99Ratio() float64 {
	return addedRatio(r.Off.Latency.P99-r.Direct.Latency.P99, r.ReverseProxy.Latency.P99-r.Direct.Latency.P99)
}

// ReverseProxyThroughputRatio is the proxy's (tracing off) requests per
// second over the plain reverse proxy's, and ReverseProxyCPURatio its CPU
// per request over the reverse proxy's.
func (r OneCoreReport) ReverseProxyThroughputRatio() float64 {
	return ratio(r.Off.Throughput(), r.ReverseProxy.Throughput())
}

func (r OneCoreReport) ReverseProxyCPURatio() float64 {
	return ratio(r.Off.CPUPerRequest(), r.ReverseProxy.CPUPerRequest())
}

// WriteTable prints the report as a table, or the reason it was skipped.
func (r OneCoreReport) WriteTable(w io.Writer) {
	if r.Skipped != "" {
		fmt.Fprintf(w, "proxy process on one core: skipped (%s)\n", r.Skipped)
		return
	}
	fmt.Fprintf(w, "proxy process on one core: osmo llmproxy as a child process, GOMAXPROCS=1, pinned to CPU %d\n\n", r.ProxyCPU)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "setup\trequests\treq/s\tp50\tp99\tCPU/req\tbusy\tcapacity on one core\t\n")
	for _, s := range r.setups() {
		if s.Name == "direct" {
			fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%s\t-\t-\t-\t\n", s.Name, s.Requests, s.Throughput(), micros(s.Latency.P50), micros(s.Latency.P99))
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%s\t%.1fµs\t%.0f%%\t%.0f req/s\t\n",
			s.Name, s.Requests, s.Throughput(), micros(s.Latency.P50), micros(s.Latency.P99), s.CPUPerRequest(), 100*s.Busy(), s.Capacity())
	}
	_ = tw.Flush()
	cpu := r.TracingCPURatio()
	fmt.Fprintf(w, "tracing/off: CPU per request %.3f (%+.1f%%), capacity on one core %.1f%%, req/s %.1f%%\n",
		cpu, 100*(cpu-1), 100/cpu, 100*r.TracingThroughputRatio())
	if r.ReverseProxy.Name != "" {
		fmt.Fprintf(w, "off against reverseproxy: added p99 %s (%s against %s over direct), req/s %.2fx, CPU per request %.2fx\n",
			addedP99Ratio(r.AddedP99Ratio()), signedMicros(r.Off.Latency.P99-r.Direct.Latency.P99), signedMicros(r.ReverseProxy.Latency.P99-r.Direct.Latency.P99),
			r.ReverseProxyThroughputRatio(), r.ReverseProxyCPURatio())
	}
	fmt.Fprintf(w, "spans received over OTLP/HTTP: tracing %d for %d calls (warm-up included; the readiness probe's 404 is one more), off %d\n",
		r.Tracing.Spans, r.Tracing.Requests+r.Tracing.Warmup, r.Off.Spans)
	gogc := "unset"
	if r.GOGC != "" {
		gogc = r.GOGC
	}
	where := "CPU"
	if len(r.BenchCPUs) > 1 {
		where = "CPUs"
	}
	where += " " + cpuList(r.BenchCPUs)
	if len(r.BenchCPUs) == 1 && r.BenchCPUs[0] == r.ProxyCPU {
		where += ", shared with the proxy (this process may use no other)"
	}
	fmt.Fprintf(w, "\n%d rounds per setup, the setups taking turns in rotating order, %d concurrent clients; proxy GOGC=%s\n", r.Rounds, r.Clients, gogc)
	fmt.Fprintf(w, "clients, upstream and OTLP sink run in this process on %s\n", where)
	fmt.Fprintln(w, "CPU/req: the proxy process's user+system time (/proc/PID/stat) over the timed requests;")
	fmt.Fprintln(w, "capacity: 1e6 / CPU/req, the rate the proxy would serve with its core saturated;")
	fmt.Fprintln(w, "req/s: what this load generator reached (busy < 100%: the proxy was not the limit);")
	fmt.Fprintln(w, "tracing: every call sampled, spans batched and exported over OTLP/HTTP to a sink that answers 200;")
	fmt.Fprintln(w, "reverseproxy: a plain httputil.ReverseProxy process run alike; direct: the clients calling the upstream")
	fmt.Fprintln(w, "  themselves, the floor each proxy's added latency is measured from")
	for _, warn := range r.Warnings {
		fmt.Fprintf(w, "warning: %s\n", warn)
	}
}

// setups are the report's measured setups, in table order.
func (r OneCoreReport) setups() []OneCoreSetup {
	out := []OneCoreSetup{r.Off, r.Tracing}
	if r.ReverseProxy.Name != "" {
		out = append(out, r.ReverseProxy)
	}
	return append(out, r.Direct)
}

func cpuList(cpus []int) string {
	s := make([]string, len(cpus))
	for i, c := range cpus {
		s[i] = strconv.Itoa(c)
	}
	return strings.Join(s, ",")
}

// MeasureOneCore measures the proxy as it runs in production: a process of
// its own (cfg.Command) with GOMAXPROCS=1, pinned to one CPU, in front of
// an upstream in this process, which moves to the other CPUs meanwhile.
// The "off" proxy does not trace; the "tracing" one exports every call's
// span over OTLP/HTTP to a sink in this process. The setups serve
// cfg.Requests requests each in cfg.Rounds rounds, taking turns in an
// order that rotates each round; the proxies' CPU time is read from /proc.
//
// When the measurement cannot run (not Linux, no command, a proxy that does
// not start), Skipped says why and the error is nil. The proxy processes
// have been stopped and waited for when it returns.
func MeasureOneCore(ctx context.Context, cfg OneCoreConfig) (OneCoreReport, error) {
	rep := OneCoreReport{Clients: cfg.Clients, Rounds: cfg.Rounds,
		Off: OneCoreSetup{Name: "off"}, Tracing: OneCoreSetup{Name: "tracing"}}
	if cfg.Requests <= 0 || cfg.Rounds <= 0 || cfg.Clients <= 0 || cfg.Requests < cfg.Rounds {
		return rep, fmt.Errorf("proxybench.MeasureOneCore: want positive Clients and Rounds and Requests >= Rounds, got %+v", cfg)
	}
	if why := oneCoreUnsupported(); why != "" {
		rep.Skipped = why
		return rep, nil
	}
	if cfg.Command == nil {
		rep.Skipped = "no command to run the proxy with"
		return rep, nil
	}

	pin, err := pinBench()
	if err != nil {
		rep.Skipped = "CPU affinity: " + err.Error()
		return rep, nil
	}
	defer pin.restore()
	rep.ProxyCPU, rep.BenchCPUs = pin.proxyCPU, pin.benchCPUs

	var stack benchStack
	defer stack.close()
	upstream, err := stack.serve(http.HandlerFunc(benchUpstream))
	if err != nil {
		return rep, fmt.Errorf("proxybench.MeasureOneCore: %w", err)
	}
	sink := &spanSink{byPID: map[int64]int64{}}
	sinkURL, err := stack.serve(sink)
	if err != nil {
		return rep, fmt.Errorf("proxybench.MeasureOneCore: %w", err)
	}

	setups := []*OneCoreSetup{&rep.Off, &rep.Tracing}
	if cfg.ReverseProxyCommand != nil {
		rep.ReverseProxy.Name = "reverseproxy"
		setups = append(setups, &rep.ReverseProxy)
	}
	rep.Direct.Name = "direct"
	setups = append(setups, &rep.Direct)
	// targets[i] is where setups[i]'s clients send; children[i] its
	// process (nil for direct).
	targets := make([]string, len(setups))
	children := make([]*benchproc.Proc, len(setups))
	defer benchproc.StopAll(children, childGrace)
	for i, s := range setups {
		if s == &rep.Direct {
			targets[i] = upstream + "/v1/chat/completions"
			continue
		}
		addr, err := benchproc.FreeAddr()
		if err != nil {
			return rep, fmt.Errorf("proxybench.MeasureOneCore: %w", err)
		}
		command := cfg.Command
		args := []string{"--addr", addr, "--upstream", upstream + "/v1", "--model", "bench-policy", "--log-level", "warn"}
		var extra []string
		switch s {
		case &rep.ReverseProxy:
			command, args = cfg.ReverseProxyCommand, []string{"--addr", addr, "--upstream", upstream}
		case &rep.Tracing:
			extra = []string{
				"OTEL_EXPORTER_OTLP_ENDPOINT=" + sinkURL,
				"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
				"OTEL_TRACES_SAMPLER=always_on",
				"OTEL_SERVICE_NAME=osmo-llmproxy-bench",
			}
		}
		cmd := command(args)
		if gogc := proxyEnv(cmd, extra); s != &rep.ReverseProxy {
			rep.GOGC = gogc
		}
		c, err := benchproc.Start(cmd.Path, cmd, pin.start)
		if err == nil {
			children[i], s.PID = c, c.PID()
			// The proxy answers GET / with 404 once it listens.
			ready, cancel := context.WithTimeout(ctx, 15*time.Second)
			err = c.WaitHTTP(ready, "http://"+addr+"/", 0)
			cancel()
		}
		if err != nil {
			if ctx.Err() != nil {
				return rep, fmt.Errorf("proxybench.MeasureOneCore: %w", context.Cause(ctx))
			}
			rep.Skipped = fmt.Sprintf("the %s proxy did not start: %v", s.Name, err)
			return rep, nil
		}
		targets[i] = "http://" + addr + "/v1/chat/completions"
	}

	clients := make([]*http.Client, len(setups))
	for i := range clients {
		tr := &http.Transport{MaxIdleConnsPerHost: cfg.Clients, DisableCompression: true}
		clients[i] = &http.Client{Transport: tr, Timeout: 30 * time.Second}
		defer tr.CloseIdleConnections()
	}
	warm := min(max(cfg.Requests/10, cfg.Clients), 1000)
	for i, s := range setups {
		if _, err := fixedLoad(ctx, clients[i], targets[i], cfg.Clients, warm, nil); err != nil {
			return rep, fmt.Errorf("proxybench.MeasureOneCore: %s warm-up: %w", s.Name, err)
		}
		s.Warmup = warm
	}

	// cpu is a proxy's CPU time so far; direct has no process.
	cpu := func(c *benchproc.Proc) (time.Duration, error) {
		if c == nil {
			return 0, nil
		}
		return procstat.CPU(c.PID())
	}
	for round := range cfg.Rounds {
		n := cfg.Requests / cfg.Rounds
		if round < cfg.Requests%cfg.Rounds {
			n++
		}
		for k := range setups {
			i := (round + k) % len(setups)
			s := setups[i]
			before, err := cpu(children[i])
			if err != nil {
				return rep, fmt.Errorf("proxybench.MeasureOneCore: %s: %w", s.Name, err)
			}
			wall, err := fixedLoad(ctx, clients[i], targets[i], cfg.Clients, n, &s.latencies)
			if err != nil {
				return rep, fmt.Errorf("proxybench.MeasureOneCore: %s: %w", s.Name, err)
			}
			after, err := cpu(children[i])
			if err != nil {
				return rep, fmt.Errorf("proxybench.MeasureOneCore: %s: %w", s.Name, err)
			}
			s.Requests += n
			s.Wall += wall
			s.CPU += after - before
		}
	}
	for _, s := range setups {
		s.Latency, s.latencies = summarize(s.latencies), nil
	}

	for i, c := range children {
		if c == nil {
			continue
		}
		if err := checkPinned(c.PID(), pin.proxyCPU); err != nil {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("%s proxy: %v", setups[i].Name, err))
		}
	}
	// Stop the proxies gently, so the tracing one flushes its last spans,
	// then count what the sink received from each.
	for _, cl := range clients {
		cl.CloseIdleConnections()
	}
	for i, c := range children {
		if c != nil && !c.Stop(childGrace) {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("%s proxy did not exit on SIGTERM within %s and was killed", setups[i].Name, childGrace))
		}
	}
	byPID, bad := sink.counts()
	if bad > 0 {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("the span sink could not decode %d export requests", bad))
	}
	for _, s := range setups {
		s.Spans = byPID[int64(s.PID)]
		if s != &rep.Direct && s.CPU <= 0 {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("%s proxy: no CPU time measured (clock ticks are 10 ms: send more requests)", s.Name))
		}
	}
	return rep, nil
}

// benchUpstream is the bench's policy: it reads the request and answers a
// fixed small completion.
func benchUpstream(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, benchCompletion)
}

// fixedLoad sends n requests from clients concurrent loops and returns the
// time they took; each request's latency is appended to *lat, when lat is
// not nil.
func fixedLoad(ctx context.Context, c *http.Client, target string, clients, n int, lat *[]time.Duration) (time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		next atomic.Int64
		wg   sync.WaitGroup
		mu   sync.Mutex
	)
	start := time.Now()
	for range clients {
		wg.Go(func() {
			var mine []time.Duration
			for next.Add(1) <= int64(n) && ctx.Err() == nil {
				t := time.Now()
				if err := benchRequest(ctx, c, target); err != nil {
					cancel(err)
					return
				}
				if lat != nil {
					mine = append(mine, time.Since(t))
				}
			}
			if lat != nil {
				mu.Lock()
				*lat = append(*lat, mine...)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if ctx.Err() != nil {
		return 0, context.Cause(ctx)
	}
	return elapsed, nil
}

// childGrace is how long a proxy process may take to exit after SIGTERM
// (the tracing one flushes its last spans) before it is killed.
const childGrace = 10 * time.Second

// proxyEnv sets cmd's environment: its own (this process's when nil)
// without any OTEL_*, OSMO_TRACE_CONTENT or GOMAXPROCS variable, then
// GOMAXPROCS=1 and extra. It returns the GOGC it keeps ("" when unset).
func proxyEnv(cmd *exec.Cmd, extra []string) (gogc string) {
	base := cmd.Env
	if base == nil {
		base = os.Environ()
	}
	env := make([]string, 0, len(base)+len(extra)+1)
	for _, kv := range base {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "OTEL_") || k == "OSMO_TRACE_CONTENT" || k == "GOMAXPROCS" {
			continue
		}
		if k == "GOGC" {
			gogc = v
		}
		env = append(env, kv)
	}
	cmd.Env = append(append(env, "GOMAXPROCS=1"), extra...)
	return gogc
}

// spanSink is an OTLP/HTTP trace receiver that answers every export with
// success and counts the spans it received from each process.
type spanSink struct {
	mu    sync.Mutex
	byPID map[int64]int64 // spans per process.pid resource attribute
	bad   int             // exports that could not be read
}

func (s *spanSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" {
		http.NotFound(w, r)
		return
	}
	// Uncompressed: the proxy's exporter gets no OTEL_EXPORTER_OTLP_COMPRESSION.
	b, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		s.failed(w, err)
		return
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &req); err != nil {
		s.failed(w, err)
		return
	}
	s.mu.Lock()
	for _, rs := range req.GetResourceSpans() {
		pid := int64(-1)
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "process.pid" {
				pid = kv.GetValue().GetIntValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			s.byPID[pid] += int64(len(ss.GetSpans()))
		}
	}
	s.mu.Unlock()
	// An empty ExportTraceServiceResponse: everything accepted.
	w.Header().Set("Content-Type", "application/x-protobuf")
	w.WriteHeader(http.StatusOK)
}

func (s *spanSink) failed(w http.ResponseWriter, err error) {
	s.mu.Lock()
	s.bad++
	s.mu.Unlock()
	http.Error(w, err.Error(), http.StatusBadRequest)
}

// counts returns the spans received so far per process id and the number
// of exports that could not be read.
func (s *spanSink) counts() (map[int64]int64, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.byPID), s.bad
}

// benchPin is where the proxies and this process run during the
// measurement.
type benchPin struct {
	proxyCPU  int
	benchCPUs []int
	// start starts a proxy process on proxyCPU.
	start func(*exec.Cmd) error
	// restore gives this process back the CPUs it had.
	restore func()
}
