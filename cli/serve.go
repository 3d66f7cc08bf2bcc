package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	"github.com/osmo-rl/osmo/gateway"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/services/grader"
	"github.com/osmo-rl/osmo/services/rollout"
)

// rowsUsage is the --training-rows flag's help, on every command that has it.
const rowsUsage = "training rows: ask the policy for the token ids and logprobs they need on every LLM call (vLLM's and SGLang's members; " +
	"a policy that refuses them is asked again without, then no more); false (or env OSMO_TRAINING_ROWS=false) asks nothing and sends the agents' calls as they came"

// defaultMaxMessageBytes bounds gRPC messages and HTTP bodies: a rollout's
// samples carry whole conversations and every recorded LLM call.
const defaultMaxMessageBytes = 64 << 20

// rolloutFlags configure the rollout service.
type rolloutFlags struct {
	workflow, workflowConfig, exec, grader, logDir, model, replicaName                 string
	execSamples, maxQueued, maxConcurrent, callbackConc                                int
	recordTTL, rolloutTimeout, gradeTimeout, drainTimeout, deliveryDeadline, lostAfter time.Duration

	noValidate, rows bool
	vocabSize        int
	recordMaxBytes   byteSize
	execLimits       execLimitsFlag
	// execEnv are KEY=VALUE variables an exec agent gets beyond the
	// contract's (an eval's [env] and secrets); not a flag.
	execEnv []string
	// apiKey is the serving command's --api-key; a local stack has none.
	apiKey   string
	nats     natsFlags
	outbound outboundFlags
	env      osmosisEnv
	osmosis  osmosisFlags

	policy policyFlags
	pause  pauseFlags
}

func (f *rolloutFlags) register(fs *flag.FlagSet, e *env) error {
	oe, err := readOsmosisEnv(e.getenv)
	if err != nil {
		return usageError{err.Error()}
	}
	f.env = oe
	fs.StringVar(&f.workflow, "workflow", e.reg.defaultWorkflow(), `workflow every rollout runs, whichever protocol started it: an agent loop or an AgentWorkflow by name, or "exec"`)
	fs.StringVar(&f.workflowConfig, "workflow-config", "", "JSON file with the workflow's config (laid over its defaults); for exec: {\"name\", \"command\": [...], \"samples\", \"settings\", ...}")
	fs.StringVar(&f.exec, "exec", "", `run this command once per sample as the workflow (an agent in any language); implies --workflow exec. `+
		`Each run works in a scratch directory of its own (under $TMPDIR, or the config's "scratch_dir"), removed when it ends; `+
		`so a relative program path and each argument naming an existing file (agent.js) are resolved against the config's "dir", default the server's working directory (see docs/workflows.md)`)
	fs.IntVar(&f.execSamples, "exec-samples", 0, "with --exec: samples (runs) per rollout (default 1, or the config's)")
	fs.Var(&f.execLimits, "exec-limits", execLimitsUsage)
	fs.BoolVar(&f.noValidate, "no-validate", false, `skip the checks of "osmo validate" at startup`)
	fs.BoolVar(&f.rows, "training-rows", e.getenv("OSMO_TRAINING_ROWS") != "false", rowsUsage)
	fs.IntVar(&f.vocabSize, "policy-vocab-size", 0, "the policy's vocabulary size `N`: a recorded token id at or above it is a training-rows problem of its call (default: unknown; only negative ids are)")
	fs.IntVar(&f.maxQueued, "max-queued", 0, "rollouts that may wait for a slot before POST /rollout answers 429 (default: --max-concurrent; remote-rollout /v1/rollout/init requests queue without bound)")
	fs.StringVar(&f.grader, "grader", "", `grader spec ("name" or "name:key=value,..."); "none" disables grading; default: the workflow's own`)
	fs.StringVar(&f.logDir, "log", "", "write one JSONL event file per rollout under `DIR`/<unix-time>/")
	fs.StringVar(&f.model, "model", "", "model name that replaces the placeholder "+`"openai/osmosis-rollout"`+" on upstream calls (default: leave it to the trainer)")
	fs.IntVar(&f.maxConcurrent, "max-concurrent", oe.maxConcurrent, "rollouts run at once; the rest queue (env OSMOSIS_ROLLOUT_SERVER_MAX_CONCURRENT_ROLLOUTS)")
	fs.DurationVar(&f.recordTTL, "record-ttl", oe.recordTTL, "keep finished rollouts this long (env OSMOSIS_ROLLOUT_SERVER_RECORD_TTL_SECONDS)")
	f.recordMaxBytes = rollout.DefaultMaxRecordBytes
	fs.Var(&f.recordMaxBytes, "record-max-bytes", "keep finished rollouts up to this `SIZE` in all (such as 256MiB or 2GiB), dropping the oldest past it")
	fs.DurationVar(&f.rolloutTimeout, "rollout-timeout", oe.requestTimeout, "deadline of one agent run (env OSMOSIS_ROLLOUT_SERVER_REQUEST_TIMEOUT_SECONDS)")
	fs.DurationVar(&f.gradeTimeout, "grade-timeout", 150*time.Second, "how long a finished rollout waits for the grader, resends included")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 10*time.Second, "on shutdown, wait this long for running rollouts before cancelling them, and as long again for their callbacks")
	fs.DurationVar(&f.deliveryDeadline, "delivery-deadline", rollout.DefaultDeliveryDeadline, "retry a callback that fails transiently (transport errors, 429, 5xx) for this long before giving up on it")
	fs.IntVar(&f.callbackConc, "callback-concurrency", rollout.DefaultCallbackConcurrency, "callback requests open at once, all trainers together; the rest wait their turn")
	fs.DurationVar(&f.lostAfter, "lost-after", rollout.DefaultLostAfter, "a replica that stops renewing its hold on its rollouts for this long (SIGKILLed, its node gone) is taken for lost: another replica concludes them")
	fs.StringVar(&f.replicaName, "replica-name", e.getenv("POD_NAME"), "this replica's name in the shared state and in the messages of rollouts interrupted by its loss (env POD_NAME; default: the host name)")
	f.nats.register(fs, e)
	f.outbound.register(fs)
	f.osmosis.register(fs)
	f.policy.register(fs, e)
	f.pause.register(fs)
	return nil
}

// graderSpec is the grader the rollout service asks for ("" means none).
func (f *rolloutFlags) graderSpec(e *env) (string, error) {
	entry, err := f.resolve(e)
	if err != nil {
		return "", err
	}
	spec := cmp.Or(f.grader, entry.grader)
	if spec == "none" {
		return "", nil
	}
	if spec != "" {
		if _, err := e.reg.grader(spec); err != nil {
			return "", usageError{"--grader: " + err.Error()}
		}
	}
	return spec, nil
}

func (f *rolloutFlags) config(e *env, log *slog.Logger, g rollout.Grader, spec string, st *natsstore.Store, reg prometheus.Registerer, tr tracing) (rollout.Config, error) {
	entry, err := f.resolve(e)
	if err != nil {
		return rollout.Config{}, err
	}
	if f.maxConcurrent <= 0 {
		return rollout.Config{}, usagef("--max-concurrent: must be positive, got %d", f.maxConcurrent)
	}
	if f.maxQueued < 0 {
		return rollout.Config{}, usagef("--max-queued: must be 0 (default) or more, got %d", f.maxQueued)
	}
	if f.deliveryDeadline <= 0 {
		return rollout.Config{}, usagef("--delivery-deadline: must be positive, got %s", f.deliveryDeadline)
	}
	if f.lostAfter < time.Second {
		return rollout.Config{}, usagef("--lost-after: must be at least 1s, got %s", f.lostAfter)
	}
	if f.callbackConc <= 0 {
		return rollout.Config{}, usagef("--callback-concurrency: must be positive, got %d", f.callbackConc)
	}
	pol, err := f.pause.settings()
	if err != nil {
		return rollout.Config{}, err
	}
	if !f.noValidate {
		if err := validateEntry(entry); err != nil {
			return rollout.Config{}, fmt.Errorf("%w (run `osmo validate` for details, or skip with --no-validate)", err)
		}
	}
	engines, err := f.policy.engines(log, reg)
	if err != nil {
		return rollout.Config{}, err
	}
	log.Info("serving workflow", "workflow", entry.name, "kind", entry.kind())
	return rollout.Config{
		AgentLoop:        entry.loop,
		Workflow:         entry.workflow,
		MaxQueued:        f.maxQueued,
		Grader:           g,
		GraderName:       spec,
		APIKey:           f.apiKey,
		MaxConcurrent:    f.maxConcurrent,
		RecordTTL:        f.recordTTL,
		MaxRecordBytes:   int64(f.recordMaxBytes),
		RolloutTimeout:   f.rolloutTimeout,
		GradeTimeout:     f.gradeTimeout,
		DrainTimeout:     f.drainTimeout,
		Callbacks:        rollout.CallbackSettings{Deadline: f.deliveryDeadline, MaxInFlight: f.callbackConc},
		State:            st,
		LostAfter:        f.lostAfter,
		ReplicaName:      f.replicaName,
		MaxMetadataBytes: f.env.maxMetadataBytes,
		Client:           f.env.client,
		Model:            f.model,
		Rows:             f.rows,
		PolicyVocabSize:  f.vocabSize,
		Outbound:         f.outbound.policy(),
		LogDir:           f.logDir,
		Logger:           log,
		Metrics:          reg,

		TracerProvider:      tr.rollout,
		ProxyTracerProvider: tr.proxy,
		Propagator:          tr.prop,
		TraceContent:        tr.content,

		Engines:           engines,
		EnginesOwnRouting: f.policy.ownsRouting,
		Policy:            pol,
	}, nil
}

// graderFlags configure the grader service.
type graderFlags struct {
	defaultSpec   string
	timeout       time.Duration
	maxConcurrent int
}

func (f *graderFlags) register(fs *flag.FlagSet, prefix string) {
	fs.DurationVar(&f.timeout, prefix+"timeout", 150*time.Second, "deadline of one grading")
	fs.IntVar(&f.maxConcurrent, prefix+"max-concurrent", 64, "gradings run at once")
}

// service builds the grader service; it keeps its gradings in state, where
// every replica on the same NATS finds them.
func (f *graderFlags) service(ctx context.Context, e *env, log *slog.Logger, reg prometheus.Registerer, tr tracing, state *natsstore.Store) (*grader.Service, error) {
	set, err := e.reg.graderSet(f.defaultSpec)
	if err != nil {
		return nil, usageError{"--grader: " + err.Error()}
	}
	svc, err := grader.New(ctx, grader.Config{
		Graders:        set,
		Default:        f.defaultSpec,
		Timeout:        f.timeout,
		MaxConcurrent:  f.maxConcurrent,
		State:          state,
		Logger:         log,
		Metrics:        reg,
		TracerProvider: tr.grader,
		Propagator:     tr.prop,
	})
	if err != nil {
		return nil, fmt.Errorf("grader service: %w", err)
	}
	return svc, nil
}

// grpcServer builds a gRPC server with the options every service shares:
// the codec, message limits, panic recovery, health and reflection, TLS
// when tf has a certificate, and tracing through tp (nil: none).
func grpcServer(addr string, log *slog.Logger, unary grpc.UnaryServerInterceptor, stream grpc.StreamServerInterceptor, tp trace.TracerProvider, prop propagation.TextMapPropagator, tf *tlsFlags) (*server.GRPC, *health.Server, error) {
	opts := append(telemetry.GRPCServerOptions(tp, prop),
		grpc.MaxRecvMsgSize(defaultMaxMessageBytes),
		grpc.MaxSendMsgSize(defaultMaxMessageBytes),
		// Connections are recycled so dns:/// clients re-resolve and spread
		// over replicas added since they connected; long streams end after
		// the grace and their clients reconnect (and resend, or replay).
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionAge: 5 * time.Minute, MaxConnectionAgeGrace: time.Minute}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.ChainUnaryInterceptor(server.RecoverUnary(log), unary),
		grpc.ChainStreamInterceptor(server.RecoverStream(log), stream),
	)
	if tf.src != nil && tf.src.HasCert() {
		opts = append(opts, grpc.Creds(tf.src.ServerCredentials()))
	}
	srv, err := server.NewGRPC(addr, opts...)
	if err != nil {
		return nil, nil, err
	}
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)
	return srv, hs, nil
}

// roundRobin balances calls and new streams over every address a dns:///
// target resolves to (a headless Service's pods); with one address it is
// the same as the default.
const roundRobin = `{"loadBalancingConfig":[{"round_robin":{}}]}`

// dialLocal connects to srv in this process, in memory (see dial).
func dialLocal(srv *server.GRPC, tp trace.TracerProvider, prop propagation.TextMapPropagator, extra ...grpc.DialOption) (*grpc.ClientConn, error) {
	return dial("passthrough:///"+srv.Addr(), tp, prop, append(extra, srv.LocalDialer())...)
}

// dial connects to a service; calls are traced through tp (nil: none).
// extra adds options, such as per-call credentials, or TLS transport
// credentials (tlsFlags.dialOptions) in place of plaintext.
func dial(addr string, tp trace.TracerProvider, prop propagation.TextMapPropagator, extra ...grpc.DialOption) (*grpc.ClientConn, error) {
	opts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, telemetry.GRPCDialOptions(tp, prop)...)
	opts = append(opts, extra...)
	opts = append(opts,
		grpc.WithDefaultServiceConfig(roundRobin),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(defaultMaxMessageBytes), grpc.MaxCallSendMsgSize(defaultMaxMessageBytes)),
	)
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", addr, err)
	}
	return conn, nil
}

// stack is the whole system in one process: grader, rollout service and
// gateway, joined by gRPC in memory exactly as they are over the network
// when split.
type stack struct {
	log        *slog.Logger
	addrFile   addrFile
	graderSrv  *server.GRPC
	graderHS   *health.Server
	rolloutSvc *rollout.Service
	rolloutSrv *server.GRPC
	rolloutHS  *health.Server
	http       *server.HTTP
	// unserved are released if the stack never serves (serving releases
	// them itself); closers are closed, last first, once it is done: the
	// shared state, opened first, last of all.
	unserved, closers []io.Closer
}

type stackConfig struct {
	httpAddr    string
	rolloutAddr string
	graderAddr  string
	maxBody     int64
	rollout     rolloutFlags
	grader      graderFlags
	tracing     tracing
	tls         tlsFlags
	addrFile    addrFile
}

// localStackConfig is a stack on loopback ports with the rollout service's
// defaults, as demo and eval run it.
func localStackConfig(e *env, workflow string) (stackConfig, error) {
	sc := stackConfig{httpAddr: "127.0.0.1:0", rolloutAddr: "127.0.0.1:0", graderAddr: "127.0.0.1:0", maxBody: defaultMaxMessageBytes}
	fs := flagSet(e, "local")
	if err := sc.rollout.register(fs, e); err != nil {
		return sc, err
	}
	sc.grader.register(fs, "grader-")
	sc.rollout.workflow = workflow
	return sc, nil
}

func newStack(ctx context.Context, e *env, log *slog.Logger, sc stackConfig) (_ *stack, err error) {
	// st is a local, not the named result, so a failed start (which
	// returns nil) still releases what it opened.
	st := &stack{log: log, addrFile: sc.addrFile}
	defer func() {
		if err != nil {
			st.unserved = append(st.unserved, st.closers...)
			st.close(st.unserved)
		}
	}()
	spec, err := sc.rollout.graderSpec(e)
	if err != nil {
		return nil, err
	}
	sc.grader.defaultSpec = cmp.Or(spec, "calculator")
	// One shared state for the stack: the rollout service's and the
	// grader's, from the rollout flags (--nats, or the embedded server).
	state, err := sc.rollout.nats.open(ctx, "osmo-serve", log)
	if err != nil {
		return nil, err
	}
	st.closers = append(st.closers, state)
	reg := newMetricsRegistry()
	tr := sc.tracing
	graderSvc, err := sc.grader.service(ctx, e, log, reg, tr, state)
	if err != nil {
		return nil, err
	}
	st.closers = append(st.closers, graderSvc)
	// The grader's RPCs need the API key too: /v1/grade and the
	// GraderService are as public as the rollout API.
	gauth := server.NewBearerAuth(sc.rollout.apiKey)
	if st.graderSrv, st.graderHS, err = grpcServer(sc.graderAddr, log, gauth.Unary, gauth.Stream, tr.grader, tr.prop, &sc.tls); err != nil {
		return nil, err
	}
	st.unserved = append(st.unserved, st.graderSrv)
	graderv1.RegisterGraderServiceServer(st.graderSrv, graderSvc)
	// The gateway calls both services in this process, in memory, through
	// their gRPC servers: the same interceptors (the clients' own
	// Authorization is checked), status and traces as from another process.
	graderConn, err := dialLocal(st.graderSrv, tr.gateway, tr.prop, sc.tls.loopbackDialOptions()...)
	if err != nil {
		return nil, err
	}
	st.closers = append(st.closers, graderConn)

	// The rollout service calls the grader service itself: nothing is
	// encoded, and no key is needed.
	var g rollout.Grader
	if spec != "" {
		g = localGrader{graderSvc}
	}
	cfg, err := sc.rollout.config(e, log, g, spec, state, reg, tr)
	if err != nil {
		return nil, err
	}
	if st.rolloutSvc, err = rollout.New(cfg); err != nil {
		return nil, err
	}
	st.unserved = append(st.unserved, st.rolloutSvc)
	if st.rolloutSrv, st.rolloutHS, err = grpcServer(sc.rolloutAddr, log, st.rolloutSvc.UnaryInterceptor, st.rolloutSvc.StreamInterceptor,
		tr.rollout, tr.prop, &sc.tls); err != nil {
		return nil, err
	}
	st.unserved = append(st.unserved, st.rolloutSrv)
	rolloutv1.RegisterRolloutServiceServer(st.rolloutSrv, st.rolloutSvc)
	rollConn, err := dialLocal(st.rolloutSrv, tr.gateway, tr.prop, sc.tls.loopbackDialOptions()...)
	if err != nil {
		return nil, err
	}
	st.closers = append(st.closers, rollConn)
	gw, err := gateway.New(gateway.Config{Rollout: rollConn, Grader: graderConn, MaxBodyBytes: sc.maxBody, Logger: log,
		TracerProvider: tr.gateway, Propagator: tr.prop})
	if err != nil {
		return nil, err
	}
	if st.http, err = sc.tls.httpServer(sc.httpAddr, withMetrics(gw, reg, sc.rollout.apiKey)); err != nil {
		return nil, err
	}
	st.unserved = append(st.unserved, st.http)
	return st, nil
}

// close closes cs, last first.
func (st *stack) close(cs []io.Closer) {
	for _, c := range slices.Backward(cs) {
		_ = c.Close()
	}
}

// run serves until ctx ends. Shutdown goes front to back: the gateway and
// rollout service stop taking work and drain, and only then does the grader
// stop, so rollouts finishing during the drain still get their rewards.
func (st *stack) run(ctx context.Context) error {
	defer st.close(st.closers)
	// The listeners are open since newStack: a caller that reads the
	// file can connect at once.
	if err := st.addrFile.write("http", st.http.URL(), "rollout_grpc", st.rolloutSrv.Addr(), "grader_grpc", st.graderSrv.Addr(), "llm_proxy", st.rolloutSvc.ProxyURL()); err != nil {
		st.close(st.unserved)
		return err
	}
	backCtx, stopBack := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBack()
	back, backCtx := errgroup.WithContext(backCtx)
	back.Go(func() error { return st.graderSrv.Serve(backCtx) })
	st.graderHS.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)

	frontParent, stopFront := context.WithCancel(ctx)
	defer stopFront()
	// A failing back end (say the grader's listener died) stops the front too.
	stop := context.AfterFunc(backCtx, stopFront)
	defer stop()
	front, frontCtx := errgroup.WithContext(frontParent)
	front.Go(func() error { return st.rolloutSvc.Serve(frontCtx) })
	front.Go(func() error { return st.rolloutSrv.Serve(frontCtx) })
	front.Go(func() error { return st.http.Serve(frontCtx) })
	st.rolloutHS.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	st.log.Info("osmo serving", "http", st.http.URL(), "rollout_grpc", st.rolloutSrv.Addr(), "grader_grpc", st.graderSrv.Addr(), "llm_proxy", st.rolloutSvc.ProxyURL())
	frontErr := front.Wait()
	st.rolloutHS.Shutdown()
	stopBack()
	return errors.Join(frontErr, back.Wait())
}

// localGrader is the stack's grader service as the rollout service's
// Grader, in process.
type localGrader struct{ svc *grader.Service }

func (g localGrader) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	return g.svc.GradeLocal(ctx, req)
}

// serviceFlags are the flags every serving command takes besides its own.
type serviceFlags struct {
	log      logFlags
	tls      tlsFlags
	addrFile addrFile
	apiKey   string
	insecure bool
}

// register adds the flags; keyUsage is --api-key's usage, which says what
// the key guards in each command.
func (f *serviceFlags) register(fs *flag.FlagSet, e *env, keyUsage string) {
	f.log.register(fs)
	f.tls.register(fs, e)
	f.addrFile.register(fs)
	secretVar(fs, &f.apiKey, "api-key", e.getenv("OSMO_API_KEY"), keyUsage)
	fs.BoolVar(&f.insecure, "insecure", e.getenv("OSMO_INSECURE") == "true",
		"serve without authentication on a non-loopback address (env OSMO_INSECURE=true); without it such a start needs --api-key")
}

// start makes the command's logger and telemetry (stop flushes it), loads
// the TLS files (serves: see tlsFlags.load) and refuses to listen beyond
// loopback with nothing authenticating callers (see checkListen).
func (f *serviceFlags) start(ctx context.Context, e *env, cmd, service string, serves bool, listens ...listenAddr) (*slog.Logger, *telemetry.Telemetry, func(), error) {
	log, tel, stop, err := f.log.start(ctx, e, service)
	if err != nil {
		return nil, nil, nil, err
	}
	if err = f.tls.load(log, serves); err == nil {
		err = f.checkListen(ctx, log, cmd, listens...)
	}
	if err != nil {
		stop()
		return nil, nil, nil, err
	}
	return log, tel, stop, nil
}

// rolloutKeyUsage is --api-key's usage where the rollout service serves.
const rolloutKeyUsage = "require this bearer `TOKEN` on every request but /health (env OSMO_API_KEY)"

func runServe(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "serve")
	var (
		port     int
		host     string
		grpcAddr string
		sf       serviceFlags
		sc       stackConfig
	)
	fs.IntVar(&port, "p", 9000, "HTTP port (REST, Connect, gRPC-Web and gRPC over h2c)")
	fs.IntVar(&port, "port", 9000, "same as -p")
	fs.StringVar(&host, "H", "0.0.0.0", "host to listen on")
	fs.StringVar(&host, "host", "0.0.0.0", "same as -H")
	fs.StringVar(&grpcAddr, "grpc-addr", "127.0.0.1:0", "native gRPC address of the rollout service")
	fs.StringVar(&sc.graderAddr, "grader-addr", "127.0.0.1:0", "gRPC address of the embedded grader service")
	fs.Int64Var(&sc.maxBody, "max-body-bytes", defaultMaxMessageBytes, "largest request body accepted")
	if err := sc.rollout.register(fs, e); err != nil {
		return err
	}
	sc.grader.register(fs, "grader-")
	sf.register(fs, e, rolloutKeyUsage)
	if err := parse(fs, args); err != nil {
		return err
	}
	if port < 0 || port > 65535 {
		return usagef("--port: must be 0..65535, got %d", port)
	}
	sc.httpAddr = net.JoinHostPort(host, strconv.Itoa(port))
	sc.rolloutAddr = grpcAddr
	log, tel, stopTelemetry, err := sf.start(ctx, e, "serve", serviceRollout, true,
		listenAddr{"-H/-p", sc.httpAddr}, listenAddr{"--grpc-addr", sc.rolloutAddr}, listenAddr{"--grader-addr", sc.graderAddr})
	if err != nil {
		return err
	}
	defer stopTelemetry()
	sc.tls, sc.addrFile, sc.tracing, sc.rollout.apiKey = sf.tls, sf.addrFile, stackTracing(tel), sf.apiKey
	stopOsmosis, err := sc.rollout.startOsmosis(ctx, e, log)
	if err != nil {
		return err
	}
	// Stopped after the stack: rollouts still draining need their servers.
	defer stopOsmosis()
	st, err := newStack(ctx, e, log, sc)
	if err != nil {
		return err
	}
	return st.run(ctx)
}

func runRollout(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "rollout")
	var (
		addr, graderAddr, metricsAddr string
		graderStreams                 int
		rf                            rolloutFlags
		sf                            serviceFlags
	)
	fs.StringVar(&addr, "grpc-addr", ":9090", "gRPC listen address")
	fs.StringVar(&metricsAddr, "metrics-addr", ":9464", "HTTP address of GET /metrics (empty: off)")
	fs.StringVar(&graderAddr, "grader-addr", "", "gRPC address of the grader service (dns:///host:port balances over its replicas)")
	fs.IntVar(&graderStreams, "grader-streams", 4, "grading streams to the grader service; with dns:/// each lands on another replica")
	if err := rf.register(fs, e); err != nil {
		return err
	}
	sf.register(fs, e, rolloutKeyUsage)
	if err := parse(fs, args); err != nil {
		return err
	}
	log, tel, stopTelemetry, err := sf.start(ctx, e, "rollout", serviceRollout, false, listenAddr{"--grpc-addr", addr})
	if err != nil {
		return err
	}
	rf.apiKey = sf.apiKey
	defer stopTelemetry()
	stopOsmosis, err := rf.startOsmosis(ctx, e, log)
	if err != nil {
		return err
	}
	defer stopOsmosis()
	spec, err := rf.graderSpec(e)
	if err != nil {
		return err
	}
	// The embedded LLM proxy's spans belong to a service of their own, as
	// in `osmo serve`.
	tr := tracing{rollout: tel.TracerProvider(), proxy: tel.ServiceTracerProvider(serviceLLMProxy), prop: tel.Propagator(), content: tel.CaptureContent()}
	var (
		g    rollout.Grader
		pool *grader.Pool
	)
	if spec != "" {
		if graderAddr == "" {
			return usagef("--grader-addr is required unless --grader none")
		}
		// The rollout service presents its API key to the grader service.
		opts := sf.tls.dialOptions()
		if rf.apiKey != "" {
			opts = append(opts, grpc.WithPerRPCCredentials(server.BearerCredentials(rf.apiKey)))
		}
		conn, err := dial(graderAddr, tr.rollout, tr.prop, opts...)
		if err != nil {
			return err
		}
		defer conn.Close()
		pool = grader.NewPool(conn, graderStreams, grader.ClientOptions{Logger: log, Propagator: tr.prop})
		g = pool
	}
	reg := newMetricsRegistry()
	serveMetrics, metricsURL, err := metricsServer(metricsAddr, reg)
	if err != nil {
		return err
	}
	st, err := rf.nats.open(ctx, "osmo-rollout", log)
	if err != nil {
		return err
	}
	defer st.Close()
	cfg, err := rf.config(e, log, g, spec, st, reg, tr)
	if err != nil {
		return err
	}
	svc, err := rollout.New(cfg)
	if err != nil {
		return err
	}
	srv, hs, err := grpcServer(addr, log, svc.UnaryInterceptor, svc.StreamInterceptor, tr.rollout, tr.prop, &sf.tls)
	if err != nil {
		return err
	}
	rolloutv1.RegisterRolloutServiceServer(srv, svc)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	log.Info("rollout service serving", "grpc", srv.Addr(), "metrics", metricsURL, "workflow", rf.workflow, "grader", spec, "llm_proxy", svc.ProxyURL())
	if err := sf.addrFile.write("grpc", srv.Addr(), "metrics", metricsURL, "llm_proxy", svc.ProxyURL()); err != nil {
		_ = srv.Close()
		return err
	}

	// The grader client outlives the drain so late rollouts still get graded.
	backCtx, stopBack := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBack()
	var back errgroup.Group
	if pool != nil {
		back.Go(func() error { return pool.Run(backCtx) })
	}
	front, fctx := errgroup.WithContext(ctx)
	front.Go(func() error { return svc.Serve(fctx) })
	front.Go(func() error { return srv.Serve(fctx) })
	front.Go(func() error { return serveMetrics(fctx) })
	err = front.Wait()
	stopBack()
	_ = back.Wait()
	return err
}

func runGrader(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "grader")
	var (
		addr, metricsAddr string
		gf                graderFlags
		nf                natsFlags
		sf                serviceFlags
	)
	fs.StringVar(&addr, "grpc-addr", ":9091", "gRPC listen address")
	fs.StringVar(&metricsAddr, "metrics-addr", ":9465", "HTTP address of GET /metrics (empty: off)")
	fs.StringVar(&gf.defaultSpec, "grader", "calculator", "default grader spec for requests that name none")
	gf.register(fs, "")
	nf.register(fs, e)
	sf.register(fs, e, "require this bearer `TOKEN` on every RPC but health (env OSMO_API_KEY); give the rollout service the same --api-key")
	if err := parse(fs, args); err != nil {
		return err
	}
	log, tel, stopTelemetry, err := sf.start(ctx, e, "grader", serviceGrader, true, listenAddr{"--grpc-addr", addr})
	if err != nil {
		return err
	}
	defer stopTelemetry()
	state, err := nf.open(ctx, "osmo-grader", log)
	if err != nil {
		return err
	}
	defer state.Close()
	tr := tracing{grader: tel.TracerProvider(), prop: tel.Propagator()}
	reg := newMetricsRegistry()
	serveMetrics, metricsURL, err := metricsServer(metricsAddr, reg)
	if err != nil {
		return err
	}
	svc, err := gf.service(ctx, e, log, reg, tr, state)
	if err != nil {
		return err
	}
	defer svc.Close()
	auth := server.NewBearerAuth(sf.apiKey)
	srv, hs, err := grpcServer(addr, log, auth.Unary, auth.Stream, tr.grader, tr.prop, &sf.tls)
	if err != nil {
		return err
	}
	graderv1.RegisterGraderServiceServer(srv, svc)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	log.Info("grader service serving", "grpc", srv.Addr(), "metrics", metricsURL, "default", gf.defaultSpec, "nats", state.URL())
	if err := sf.addrFile.write("grpc", srv.Addr(), "metrics", metricsURL); err != nil {
		_ = srv.Close()
		return err
	}
	var g errgroup.Group
	g.Go(func() error { return srv.Serve(ctx) })
	g.Go(func() error { return serveMetrics(ctx) })
	return g.Wait()
}

func runGateway(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "gateway")
	var (
		addr, rolloutAddr, graderAddr string
		maxBody                       int64
		sf                            serviceFlags
	)
	fs.StringVar(&addr, "addr", ":9000", "HTTP listen address (REST, Connect, gRPC-Web, gRPC over h2c)")
	fs.StringVar(&rolloutAddr, "rollout-addr", "", "gRPC address of the rollout service (required)")
	fs.StringVar(&graderAddr, "grader-addr", "", "gRPC address of the grader service (optional: enables /v1/grade)")
	fs.Int64Var(&maxBody, "max-body-bytes", defaultMaxMessageBytes, "largest request body accepted")
	sf.register(fs, e, "require this bearer `TOKEN` on every request but /health, and forward it to the services (env OSMO_API_KEY); give them the same --api-key")
	if err := parse(fs, args); err != nil {
		return err
	}
	if rolloutAddr == "" {
		return usagef("--rollout-addr is required")
	}
	log, tel, stopTelemetry, err := sf.start(ctx, e, "gateway", serviceGateway, false, listenAddr{"--addr", addr})
	if err != nil {
		return err
	}
	defer stopTelemetry()
	tp, prop := tel.TracerProvider(), tel.Propagator()
	rconn, err := dial(rolloutAddr, tp, prop, sf.tls.dialOptions()...)
	if err != nil {
		return err
	}
	defer rconn.Close()
	cfg := gateway.Config{Rollout: rconn, MaxBodyBytes: maxBody, Logger: log, TracerProvider: tp, Propagator: prop}
	if graderAddr != "" {
		gconn, err := dial(graderAddr, tp, prop, sf.tls.dialOptions()...)
		if err != nil {
			return err
		}
		defer gconn.Close()
		cfg.Grader = gconn
	}
	gw, err := gateway.New(cfg)
	if err != nil {
		return err
	}
	srv, err := sf.tls.httpServer(addr, requireKeyHTTP(sf.apiKey, withMetrics(gw, newMetricsRegistry(), "")))
	if err != nil {
		return err
	}
	log.Info("gateway serving", "http", srv.URL(), "rollout", rolloutAddr, "grader", graderAddr)
	if err := sf.addrFile.write("http", srv.URL()); err != nil {
		_ = srv.Close()
		return err
	}
	return srv.Serve(ctx)
}
