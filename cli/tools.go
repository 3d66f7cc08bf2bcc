package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/osmo-rl/osmo/internal/proxybench"
	"github.com/osmo-rl/osmo/internal/rolloutbench"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

func runLLMProxy(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "llmproxy")
	var (
		addr, upstream, model, apiKey string
		retries                       int
		timeout, baseDelay, maxDelay  time.Duration
		maxBody                       int64
		keep                          int
		rows                          bool
		lf                            logFlags
		pf                            policyFlags
	)
	fs.StringVar(&addr, "addr", ":9002", "HTTP listen address")
	fs.StringVar(&upstream, "upstream", "", "OpenAI base URL of the policy, e.g. http://vllm:8000/v1: one engine, as --policy URL (--upstream or --policy is required)")
	pf.register(fs, e)
	fs.StringVar(&model, "model", "", `model that replaces the placeholder "openai/osmosis-rollout"`)
	secretVar(fs, &apiKey, "upstream-api-key", e.getenv("OSMO_UPSTREAM_API_KEY"), "bearer `TOKEN` sent upstream instead of the client's (env OSMO_UPSTREAM_API_KEY)")
	fs.IntVar(&retries, "max-retries", 3, "retries on 5xx, timeouts and transport errors")
	fs.DurationVar(&timeout, "timeout", 300*time.Second, "per-attempt upstream timeout")
	fs.DurationVar(&baseDelay, "retry-base-delay", time.Second, "first retry delay (doubles each retry)")
	fs.DurationVar(&maxDelay, "retry-max-delay", 30*time.Second, "retry delay cap")
	fs.Int64Var(&maxBody, "max-body-bytes", 32<<20, "largest request body accepted")
	fs.IntVar(&keep, "keep-calls", 10000, "recorded calls kept in memory for GET /r/{rollout_id}/calls")
	fs.BoolVar(&rows, "training-rows", e.getenv("OSMO_TRAINING_ROWS") != "false", rowsUsage)
	lf.register(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if upstream == "" && len(pf.urls) == 0 && len(pf.fromEnv) == 0 {
		return usagef("--policy: at least one engine is required (or --upstream)")
	}
	var extra []string
	if upstream != "" {
		if u, err := url.Parse(upstream); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return usagef("--upstream: want an http(s) base URL such as http://127.0.0.1:8000/v1, got %q", upstream)
		}
		extra = append(extra, strings.TrimRight(upstream, "/"))
	}
	log, tel, stopTelemetry, err := lf.start(ctx, e, serviceLLMProxy)
	if err != nil {
		return err
	}
	defer stopTelemetry()
	reg := newMetricsRegistry()
	engines, err := pf.engines(log, reg, extra...)
	if err != nil {
		return err
	}
	store := llmproxy.NewStore(keep, time.Hour)
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:         llmproxy.StaticRouter(llmproxy.Route{APIKey: apiKey, Model: model}),
		Engines:        engines,
		Recorder:       store,
		Retry:          llmproxy.RetryPolicy{MaxRetries: retries, BaseDelay: baseDelay, MaxDelay: maxDelay},
		Timeout:        timeout,
		MaxBodyBytes:   maxBody,
		AskTokens:      rows,
		Logger:         log,
		Metrics:        reg,
		TracerProvider: tel.TracerProvider(),
		Propagator:     tel.Propagator(),
		CaptureContent: tel.CaptureContent(),
	})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /r/{rollout_id}/calls", store)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"status":"ok"}`)
	})
	mux.Handle("/", proxy)
	srv, err := server.NewHTTP(addr, withMetrics(mux, reg, ""))
	if err != nil {
		return err
	}
	log.Info("llm proxy serving", "http", srv.URL(), "engines", engines.URLs(), "model", model)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	enginesDone := make(chan error, 1)
	go func() { enginesDone <- engines.Run(runCtx) }()
	err = srv.Serve(ctx)
	stop()
	return errors.Join(err, <-enginesDone)
}

// runBench is osmo bench: the proxy's figures, then the rollouts'; `bench
// proxy` and `bench rollouts` print one of them, `bench reverse-proxy`
// serves the plain proxy the proxy's figures compare with.
func runBench(ctx context.Context, e *env, args []string) error {
	sub := ""
	if len(args) > 0 && slices.Contains([]string{"proxy", "rollouts", "reverse-proxy", "plane"}, args[0]) {
		sub, args = args[0], args[1:]
	}
	switch sub {
	case "reverse-proxy":
		return runBenchReverseProxy(ctx, e, args)
	case "plane":
		return runBenchPlane(ctx, e, args)
	}
	fs := flagSet(e, strings.TrimSpace("bench "+sub))
	n := 5000
	var rb rolloutBenchFlags
	if sub != "rollouts" {
		fs.IntVar(&n, "n", 5000, "sequential requests per setup (the one-core section sends 4n per setup)")
	}
	if sub != "proxy" {
		rb.register(fs)
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if n < 100 {
		return usagef("-n: at least 100 requests are needed for a p99, got %d", n)
	}
	if sub != "proxy" {
		if err := rb.check(); err != nil {
			return err
		}
	}
	// With --baseline a comparison is all that is asked for.
	if sub != "rollouts" && rb.baseline == "" {
		if err := benchProxy(ctx, e, n); err != nil || sub == "proxy" {
			return err
		}
	}
	return rb.run(ctx, e)
}

// benchProxy measures the proxy in one process against
// httputil.ReverseProxy and a direct call, then as its own process on one
// core, with n requests per setup.
func benchProxy(ctx context.Context, e *env, n int) error {
	// The traced setup runs the proxy's span pipeline, sampling every call,
	// in front of an exporter that drops the batches: the cost measured is
	// the proxy's, not a collector's.
	tp := telemetry.NewTracerProvider(tracetest.NewNoopExporter(), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	defer func() { _ = tp.Shutdown(context.WithoutCancel(ctx)) }()
	rep, err := proxybench.MeasureOverhead(ctx, n, tp)
	if err != nil {
		return err
	}
	rep.WriteTable(e.stdout)
	fmt.Fprintln(e.stdout)

	// The proxy alone: `osmo llmproxy` as a child process on a core of its
	// own, tracing off and exporting over OTLP/HTTP. 4n requests per setup
	// give each about a second of proxy CPU time at the default n, enough
	// for /proc's 10 ms clock ticks.
	command, err := osmoCommand(e, "llmproxy")
	if err != nil {
		proxybench.OneCoreReport{Skipped: err.Error()}.WriteTable(e.stdout)
		return nil
	}
	bench, _ := osmoCommand(e, "bench") // the executable was just found
	reverseProxy := func(args []string) *exec.Cmd { return bench(append([]string{"reverse-proxy"}, args...)) }
	one, err := proxybench.MeasureOneCore(ctx, proxybench.OneCoreConfig{Command: command, ReverseProxyCommand: reverseProxy,
		Requests: 4 * n, Rounds: 10, Clients: 8})
	if err != nil {
		return err
	}
	one.WriteTable(e.stdout)
	fmt.Fprintln(e.stdout)
	return nil
}

// runBenchReverseProxy serves the plain httputil.ReverseProxy that osmo
// bench runs beside `osmo llmproxy` on one core, to compare them.
func runBenchReverseProxy(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "bench reverse-proxy")
	addr := fs.String("addr", "127.0.0.1:0", "`host:port` to listen on")
	upstream := fs.String("upstream", "", "base `URL` to forward every request to, its path appended")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *upstream == "" {
		return usagef("--upstream is required")
	}
	return proxybench.ServeReverseProxy(ctx, *addr, *upstream)
}

// rolloutBenchFlags configure the end-to-end rollout figures.
type rolloutBenchFlags struct {
	rollouts, concurrency, inFlight, maxConcurrent int
	workflow                                       string
	state, cluster                                 bool
	stateSync                                      string
	// baseline, when set, is another osmo build whose osmo serve is
	// compared with this one's, rounds times each.
	baseline string
	rounds   int
	// serverEnv and baselineEnv are set in the environment of the osmo
	// processes measured, this build's and the baseline's.
	serverEnv, baselineEnv envVars
}

// envVars collects repeated NAME=value flags.
type envVars []string

func (v *envVars) String() string { return strings.Join(*v, " ") }

func (v *envVars) Set(s string) error {
	if name, _, ok := strings.Cut(s, "="); !ok || name == "" {
		return fmt.Errorf("want NAME=value, got %q", s)
	}
	*v = append(*v, s)
	return nil
}

func (f *rolloutBenchFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&f.rollouts, "rollouts", 2000, "rollouts timed end to end")
	fs.IntVar(&f.concurrency, "concurrency", 64, "rollouts in flight while timing")
	fs.IntVar(&f.inFlight, "in-flight", 2000, "rollouts held in their LLM call at once for the memory figures")
	fs.IntVar(&f.maxConcurrent, "max-concurrent", 0, "osmo serve's --max-concurrent (default: a slot for every rollout in flight); fewer make the rest wait in its queue")
	fs.StringVar(&f.workflow, "workflow", "multiply", "the workflow osmo serve runs (graded by its own grader)")
	fs.BoolVar(&f.state, "state", false, "run osmo serve with --state in a temporary directory: its embedded NATS server keeps the state in files there")
	fs.StringVar(&f.stateSync, "state-sync", "", `with --state: the server's --state-sync ("always", or an fsync interval such as 1s; default the server's, 2m)`)
	fs.StringVar(&f.baseline, "baseline", "", "another osmo `PROGRAM` (an earlier build, say): run its osmo serve and this one's alternately with the same load (the timed rollouts, then --in-flight held), print both builds' figures and their ratios, and nothing else")
	fs.IntVar(&f.rounds, "rounds", 3, "with --baseline: runs of each server, alternately first")
	fs.Var(&f.serverEnv, "server-env", "`VAR`=value set in the environment of this build's osmo processes measured (repeatable; GOGC=100, say)")
	fs.Var(&f.baselineEnv, "baseline-env", "with --baseline: `VAR`=value set in the environment of the baseline's osmo serve (repeatable)")
	fs.BoolVar(&f.cluster, "cluster", true, "also measure 3 osmo rollout replicas behind osmo gateway over a 3-node NATS cluster (nats-server from $OSMO_NATS_BIN or scripts/nats.sh)")
}

func (f *rolloutBenchFlags) check() error {
	if f.rollouts < 100 || f.concurrency < 1 || f.inFlight < 1 {
		return usagef("--rollouts (at least 100 for a p99), --concurrency and --in-flight must be positive")
	}
	if f.maxConcurrent < 0 {
		return usagef("--max-concurrent: must not be negative, got %d", f.maxConcurrent)
	}
	if f.rounds < 1 {
		return usagef("--rounds: must be at least 1, got %d", f.rounds)
	}
	if f.baseline != "" && f.state {
		return usagef("--baseline compares osmo serve's default, in-memory state: drop --state")
	}
	if f.baseline == "" && len(f.baselineEnv) > 0 {
		return usagef("--baseline-env needs --baseline")
	}
	return nil
}

// run measures `osmo serve` end to end, then the cluster unless told not
// to, and prints the table.
func (f *rolloutBenchFlags) run(ctx context.Context, e *env) error {
	serve, err := osmoCommand(e, "serve", f.serverEnv...)
	if err != nil {
		fmt.Fprintln(e.stdout, "Rollouts end to end: skipped:", err)
		return nil
	}
	cfg := rolloutbench.Config{
		Serve: serve, Rollouts: f.rollouts, Concurrency: f.concurrency, InFlight: f.inFlight, MaxConcurrent: f.maxConcurrent, Workflow: f.workflow, Timeout: 15 * time.Minute,
	}
	if f.baseline != "" {
		return f.compare(ctx, e, cfg)
	}
	if f.state {
		dir, err := os.MkdirTemp("", "osmo-bench-state-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		cfg.StateDir, cfg.StateSync = dir, f.stateSync
	}
	var skipped string
	if f.cluster {
		if cfg.Cluster, err = f.clusterCommands(ctx, e); err != nil {
			skipped = err.Error()
		}
	}
	rep, err := rolloutbench.Measure(ctx, cfg)
	if err != nil {
		return err
	}
	rep.ClusterSkipped = skipped
	rep.WriteTable(e.stdout)
	return nil
}

// compare times this build's osmo serve against the baseline's.
func (f *rolloutBenchFlags) compare(ctx context.Context, e *env, cfg rolloutbench.Config) error {
	exe, err := exec.LookPath(f.baseline)
	if err != nil {
		return usagef("--baseline: %v", err)
	}
	baseline := programCommand(e, exe, "serve", f.baselineEnv...)
	cfg.Timeout = time.Duration(f.rounds) * 10 * time.Minute
	c, err := rolloutbench.Compare(ctx, cfg, f.baseline, baseline, f.rounds)
	if err != nil {
		return err
	}
	c.WriteTable(e.stdout)
	return nil
}

// clusterCommands are the programs of the cluster figure; the error says
// why it cannot be measured.
func (f *rolloutBenchFlags) clusterCommands(ctx context.Context, e *env) (*rolloutbench.Cluster, error) {
	nats, err := rolloutbench.FindNATS(ctx, e.getenv("OSMO_NATS_BIN"))
	if err != nil {
		return nil, err
	}
	cl := &rolloutbench.Cluster{NATS: nats}
	for sub, dst := range map[string]*func([]string) *exec.Cmd{"rollout": &cl.Rollout, "grader": &cl.Grader, "gateway": &cl.Gateway} {
		if *dst, err = osmoCommand(e, sub, f.serverEnv...); err != nil {
			return nil, err
		}
	}
	return cl, nil
}

// osmoCommand runs this program's command sub (see programCommand).
func osmoCommand(e *env, sub string, vars ...string) (func([]string) *exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("cannot find this program's executable: %w", err)
	}
	return programCommand(e, exe, sub, vars...), nil
}

// programCommand builds commands running the osmo at exe with subcommand
// sub. Unless the environment sets GOGC, they get GOGC=DefaultGCPercent,
// which they would apply anyway, so that the report can state it; vars
// (NAME=value) are set last.
func programCommand(e *env, exe, sub string, vars ...string) func([]string) *exec.Cmd {
	environ := os.Environ()
	if e.getenv("GOGC") == "" {
		environ = append(environ, "GOGC="+strconv.Itoa(DefaultGCPercent))
	}
	environ = append(environ, vars...)
	return func(args []string) *exec.Cmd {
		cmd := exec.Command(exe, append([]string{sub}, args...)...)
		cmd.Env = slices.Clone(environ)
		return cmd
	}
}

func runHealth(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "health")
	var (
		timeout time.Duration
		service string
	)
	fs.DurationVar(&timeout, "timeout", 3*time.Second, "give up after this long")
	fs.StringVar(&service, "service", "", "gRPC health service name (empty: the whole server)")
	var tf tlsFlags
	tf.register(fs, e)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := tf.load(nil, false); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usagef("usage: osmo health [flags] ADDR (host:port for gRPC, or an http(s) URL)")
	}
	target := fs.Arg(0)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if strings.HasPrefix(target, "http://") || strings.HasPrefix(target, "https://") {
		u, err := url.Parse(target)
		if err != nil {
			return usagef("ADDR: %v", err)
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/health"
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
		if err != nil {
			return err
		}
		client := http.DefaultClient
		if tf.src != nil {
			client = &http.Client{Transport: &http.Transport{TLSClientConfig: tf.src.ClientConfig(), ForceAttemptHTTP2: true}}
		}
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("health %s: %w", u, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("health %s: HTTP %d: %s", u, resp.StatusCode, strings.TrimSpace(string(body)))
		}
		fmt.Fprintln(e.stdout, strings.TrimSpace(string(body)))
		return nil
	}
	conn, err := dial(target, nil, nil, tf.dialOptions()...)
	if err != nil {
		return err
	}
	defer conn.Close()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return fmt.Errorf("health %s: %w", target, err)
	}
	fmt.Fprintln(e.stdout, resp.GetStatus())
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("health %s: %s", target, resp.GetStatus())
	}
	return nil
}
