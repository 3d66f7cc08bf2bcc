package rollout

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/inproc"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/netguard"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// Grader is the grader service as the rollout service uses it. Grade blocks
// until the grader answered (resending as needed) or ctx ends.
type Grader interface {
	Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error)
}

// Service implements rolloutv1.RolloutServiceServer.
type Service struct {
	rolloutv1.UnimplementedRolloutServiceServer

	cfg Config
	// workflow is what every rollout runs: Workflow, or AgentLoop made one.
	workflow *osmo.Workflow
	auth     *server.BearerAuth
	// seal encrypts the trainers' secrets the shared state keeps.
	seal seal
	log  *slog.Logger
	// store holds the rollouts this replica runs or concludes; sh is the
	// state every replica shares (ownState: opened and closed here), in
	// which replica names this process.
	store    *store
	sh       *shared
	ownState bool
	replica  string
	leases   leases
	waiters  waiters
	logDir   string
	metrics  *metrics
	tracer   trace.Tracer // nil when not tracing

	// running counts the rollouts whose workflow runs here.
	running   atomic.Int64
	completed atomic.Int64
	// sem holds a slot per running workflow: the server's limit, or the
	// workflow's own when it is lower.
	sem chan struct{}

	// The embedded LLM proxy and the client workflows reach it with.
	routes    *llmproxy.RouteTable
	proxySrv  *http.Server
	proxyLn   net.Listener
	proxyURL  string
	llmClient *http.Client
	// callbackClient posts the callbacks, at most cap(callbackSlots) at once
	// (every trainer together), so a burst reaches a trainer at a pace it
	// can answer.
	callbackClient *http.Client
	callbackSlots  chan struct{}
	// outbound are the client transports New made: Serve closes their idle
	// connections as it returns, or a server on the other end waits for
	// them.
	outbound []*http.Transport
	g1Policy callbackPolicy
	g2Policy callbackPolicy
	// rejectSem bounds the refused starts reported at once.
	rejectSem chan struct{}

	// rolloutsCtx parents every rollout; cancelling it aborts them all.
	rolloutsCtx    context.Context
	cancelRollouts context.CancelFunc
	// deliverCtx parents every delivery: it outlives rolloutsCtx, and ends
	// when shutdown stops waiting for callbacks.
	deliverCtx   context.Context
	stopDelivery context.CancelCauseFunc
	// streamsCtx ends the rows streams when shutdown starts: their clients
	// resume on another replica rather than hold this one's server open.
	streamsCtx  context.Context
	stopStreams context.CancelFunc
	// wg counts the goroutines the drain waits for.
	wg activity
	// admitWithin is admissionTimeout (a test shortens it).
	admitWithin time.Duration

	// policy is the shared pause switch (policy.go); upstreams are the
	// engines it reaches when Config.Policy.Engines is nil.
	policy    *policy
	upstreams upstreams
	staleness *stalenessMetrics
}

// upstreamBufferSize is the read and write buffer of each connection to
// the policy server.
const upstreamBufferSize = 1 << 10

// callbackBufferSize is the write buffer of each connection to a trainer.
const callbackBufferSize = 16 << 10

// New validates cfg, opens the embedded LLM proxy's listener and returns a
// Service ready to accept rollouts. Serve runs its background work.
func New(cfg Config) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	wf := cfg.Workflow
	if wf == nil {
		var err error
		if wf, err = osmo.AgentLoopWorkflow(cfg.AgentLoop); err != nil {
			return nil, fmt.Errorf("rollout.New: %w", err)
		}
	}
	sl, err := newSeal(cfg.APIKey)
	if err != nil {
		return nil, fmt.Errorf("rollout.New: %w", err)
	}
	logDir, err := makeLogDir(cfg.LogDir, time.Now())
	if err != nil {
		return nil, err
	}
	s := &Service{
		cfg:      cfg,
		workflow: wf,
		// All RPCs need the key but Health (the Osmosis /health) and the
		// standard health and reflection services.
		auth:        server.NewBearerAuth(cfg.APIKey, rolloutv1.RolloutService_Health_FullMethodName),
		seal:        sl,
		log:         cfg.Logger.With("service", "rollout"),
		logDir:      logDir,
		metrics:     newMetrics(cfg.Metrics),
		staleness:   newStalenessMetrics(cfg.Metrics),
		routes:      llmproxy.NewRouteTable(),
		rejectSem:   make(chan struct{}, maxRejectedDeliveries),
		admitWithin: admissionTimeout,
		g1Policy: callbackPolicy{
			BaseDelay: cfg.Client.RetryBaseDelay,
			MaxDelay:  cfg.Client.RetryMaxDelay,
			Timeout:   cfg.Client.Timeout,
			Deadline:  cfg.Callbacks.Deadline,
			Delivered: g1Delivered,
			Retryable: g1Retryable,
		},
		g2Policy: callbackPolicy{
			BaseDelay: cfg.Callbacks.BaseDelay,
			MaxDelay:  cfg.Callbacks.MaxDelay,
			Timeout:   cfg.Callbacks.Timeout,
			Deadline:  cfg.Callbacks.Deadline,
			Delivered: g2Delivered,
			Retryable: g2Retryable,
		},
	}
	s.store = newStore()
	s.leases.msgs = map[jetstream.Msg]struct{}{}
	s.replica = replicaName(cfg.ReplicaName)
	limit := cfg.MaxConcurrent
	if n := wf.MaxConcurrent(); n > 0 {
		limit = min(limit, n)
	}
	s.sem = make(chan struct{}, limit)
	upstream := &http.Transport{
		DialContext:         cfg.Outbound.Dialer(nil).DialContext,
		MaxConnsPerHost:     cfg.Client.MaxConnections,
		MaxIdleConnsPerHost: cfg.Client.MaxKeepaliveConnections,
		MaxIdleConns:        cfg.Client.MaxConnections,
		IdleConnTimeout:     90 * time.Second,
		// Every rollout in its LLM call holds a connection, so its buffers
		// are paid per rollout in flight; 1 KiB holds any response head.
		ReadBufferSize:  upstreamBufferSize,
		WriteBufferSize: upstreamBufferSize,
	}
	s.outbound = append(s.outbound, upstream)
	// Pauses go to the configured engines, else to the engine set's in the
	// ring and the policy servers trainers named for the rollouts this
	// replica runs or ran (which serve calls unless the set owns the
	// routing).
	engines := cfg.Policy.Engines
	switch {
	case engines == nil && cfg.Engines != nil:
		engines = engineUnion{enginesUp{cfg.Engines}, &s.upstreams}
	case engines == nil:
		engines = &s.upstreams
	}
	gate, err := llmproxy.NewGate(llmproxy.GateConfig{
		Engines: engines,
		// The engines are the policy's servers: the same guarded dialer.
		Client:  &http.Client{Transport: upstream, Timeout: cfg.Policy.AckTimeout, CheckRedirect: netguard.CheckRedirect},
		Metrics: cfg.Metrics,
	})
	if err != nil {
		return nil, fmt.Errorf("rollout.New: %w", err)
	}
	s.policy = &policy{gate: gate, replica: s.replica, log: s.log, timeout: cfg.Policy.AckTimeout, heartbeat: cfg.Policy.Heartbeat}
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:   s.routes,
		Recorder: llmproxy.RecorderFunc(s.recordCall),
		Retry: llmproxy.RetryPolicy{
			MaxRetries: cfg.Client.MaxRetries,
			BaseDelay:  cfg.Client.RetryBaseDelay,
			MaxDelay:   cfg.Client.RetryMaxDelay,
		},
		Timeout: cfg.Client.Timeout,
		// Straight to the policy (no forward proxy or redirect), so the
		// guarded dialer sees the address each call reaches.
		Transport:       upstream,
		Logger:          cfg.Logger,
		RequireSampleID: true,
		AskTokens:       cfg.Rows,
		Metrics:         cfg.Metrics,
		TracerProvider:  cfg.ProxyTracerProvider,
		Propagator:      cfg.Propagator,
		CaptureContent:  cfg.TraceContent,

		Engines:           cfg.Engines,
		EnginesOwnRouting: cfg.EnginesOwnRouting,
		Gate:              gate,
	})
	if err != nil {
		return nil, fmt.Errorf("rollout.New: %w", err)
	}
	ln, err := net.Listen("tcp", cfg.ProxyAddr)
	if err != nil {
		return nil, fmt.Errorf("rollout.New: proxy listener: %w", err)
	}
	s.proxyLn = ln
	s.proxyURL = "http://" + ln.Addr().String()
	s.proxySrv = &http.Server{Handler: proxy, ReadHeaderTimeout: 10 * time.Second}
	// Workflows in this process reach the proxy's handler in memory (exec
	// agents use the listener). No client timeout: the proxy times each
	// attempt, the rollout's context the rest.
	s.llmClient = &http.Client{Transport: inproc.Transport{Handler: proxy, Whole: notStreamed}}
	callbackClient := cfg.HTTPClient
	if callbackClient == nil {
		// As the proxy's: direct connections, each address checked, and no
		// redirect to another host.
		callbacks := &http.Transport{
			DialContext:         cfg.Outbound.Dialer(nil).DialContext,
			MaxConnsPerHost:     cfg.Client.MaxConnections,
			MaxIdleConnsPerHost: cfg.Client.MaxKeepaliveConnections,
			IdleConnTimeout:     90 * time.Second,
			// A trainer's answer is drained unread.
			DisableCompression: true,
			// A grader callback fits in one write.
			WriteBufferSize: callbackBufferSize,
		}
		s.outbound = append(s.outbound, callbacks)
		callbackClient = &http.Client{Transport: callbacks, CheckRedirect: netguard.CheckRedirect}
	}
	if tp := cfg.TracerProvider; tp != nil {
		s.tracer = tp.Tracer(tracerName)
		// Each LLM call and callback attempt is a client span.
		s.llmClient = tracedClient(s.llmClient, tp, cfg, func(*http.Request) string {
			return "POST /r/{rollout_id}/s/{sample_id}/v1/chat/completions"
		})
		callbackClient = tracedClient(callbackClient, tp, cfg, attemptSpanName)
	}
	s.callbackClient = callbackClient
	s.callbackSlots = make(chan struct{}, cfg.Callbacks.MaxInFlight)
	s.rolloutsCtx, s.cancelRollouts = context.WithCancel(context.Background())
	s.deliverCtx, s.stopDelivery = context.WithCancelCause(context.Background())
	s.streamsCtx, s.stopStreams = context.WithCancel(context.Background())
	st := cfg.State
	if st == nil {
		if st, err = natsstore.Open(context.Background(), natsstore.Config{Name: "osmo-rollout", Logger: s.log}); err != nil {
			ln.Close()
			return nil, fmt.Errorf("rollout.New: %w", err)
		}
		s.ownState = true
	}
	// A cluster whose nodes are (re)starting answers late: Setup retries.
	if err = st.Setup(context.Background(), "rollout streams and buckets", func(ctx context.Context) (err error) {
		if s.sh, err = openShared(ctx, st, cfg); err != nil {
			return err
		}
		s.policy.kv, err = openPolicy(ctx, st)
		return err
	}); err != nil {
		ln.Close()
		if s.ownState {
			_ = st.Close()
		}
		return nil, fmt.Errorf("rollout.New: %w", err)
	}
	s.sh.wrote = func(n int) {
		s.metrics.stateWrites.Inc()
		s.metrics.stateBytes.Add(float64(n))
	}
	s.metrics.watchShared(cfg.Metrics, s.sh)
	s.log.Info("rollout replica", "replica", s.replica, "nats", st.URL(), "lost_after", cfg.LostAfter)
	return s, nil
}

// notStreamed reports whether an LLM call's answer is served whole, so the
// proxy's handler can run in the caller's goroutine (a goroutine stack per
// rollout in flight saved). A body that holds "stream" anywhere is taken
// to ask for a stream.
func notStreamed(req *http.Request) bool {
	if req.GetBody == nil {
		return false
	}
	rc, err := req.GetBody()
	if err != nil {
		return false
	}
	defer rc.Close()
	body, err := io.ReadAll(rc)
	return err == nil && !bytes.Contains(body, []byte(`"stream"`))
}

// tracedClient is a copy of c whose requests are client spans named by
// name.
func tracedClient(c *http.Client, tp trace.TracerProvider, cfg Config, name func(*http.Request) string) *http.Client {
	base := c.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	traced := *c
	traced.Transport = otelhttp.NewTransport(base,
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(cfg.Propagator),
		otelhttp.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return name(r) }))
	return &traced
}

// Close releases the embedded proxy's listener of a Service that will not
// Serve (Serve releases it itself).
func (s *Service) Close() error {
	err := s.proxyLn.Close()
	if s.ownState {
		_ = s.sh.store.Close()
	}
	return err
}

// replicaName is this process's name in the shared state: name (the host
// name when empty) and a random suffix, so that a replica restarted under
// the same name is not taken for the one it replaces.
func replicaName(name string) string {
	if name == "" {
		name, _ = os.Hostname()
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return name + "-" + hex.EncodeToString(b[:])
}

// ProxyURL is the base URL of the embedded LLM proxy (http://127.0.0.1:PORT).
func (s *Service) ProxyURL() string { return s.proxyURL }

// Serve takes rollouts from the queue and callbacks from the outbox, and
// runs the embedded proxy, until ctx ends; then it drains (see drain) and
// returns when all is let go of.
func (s *Service) Serve(ctx context.Context) error {
	nc := s.sh.store.NC
	subs := make([]*nats.Subscription, 0, 2)
	for subj, h := range map[string]nats.MsgHandler{subjectCancel: s.answerCancels, subjectGet + natsstore.Key(s.replica): s.answerGets} {
		sub, err := nc.Subscribe(subj, h)
		if err != nil {
			return fmt.Errorf("rollout: subscribe %s: %w", subj, err)
		}
		subs = append(subs, sub)
	}
	defer func() {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
	}()
	// The policy state is applied before any rollout runs: a replica that
	// starts while the policy is paused starts paused.
	policyCtx, stopPolicy := context.WithCancel(context.Background())
	defer func() {
		// Its acknowledgement is deleted before the state can be closed.
		stopPolicy()
		s.policy.running.Wait()
	}()
	if err := s.policy.start(policyCtx, s.sh.store); err != nil {
		return err
	}
	errc := make(chan error, 2)
	go func() {
		if err := s.proxySrv.Serve(s.proxyLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("rollout: proxy: %w", err)
		}
	}()
	if e := s.cfg.Engines; e != nil {
		// The engines are probed until the proxy is shut down.
		enginesCtx, stopEngines := context.WithCancel(context.WithoutCancel(ctx))
		enginesDone := make(chan struct{})
		go func() {
			defer close(enginesDone)
			if err := e.Run(enginesCtx); err != nil {
				errc <- fmt.Errorf("rollout: engines: %w", err)
			}
		}()
		defer func() {
			stopEngines()
			<-enginesDone
		}()
	}
	takeCtx, stopTaking := context.WithCancel(context.Background())
	defer stopTaking()
	renewCtx, stopRenewing := context.WithCancel(context.Background())
	defer stopRenewing()
	go s.leases.renew(renewCtx, s.cfg.LostAfter/3, s.log)
	// The loops that start rollouts stop before the drain waits.
	var starting, loops sync.WaitGroup
	starting.Go(func() {
		if s.sh.local != nil {
			s.takePrivate(takeCtx, s.sh.local)
			return
		}
		s.takeWork(takeCtx)
	})
	// Rollouts cancelled while queued are concluded at once, without a
	// slot; the outbox's attempts under way go on under the delivery
	// context.
	limit := s.cfg.Callbacks.MaxInFlight
	starting.Go(func() {
		s.serveConsumer(takeCtx, s.sh.control, limit, func(msg jetstream.Msg) { s.take(msg, func() {}, true) })
	})
	loops.Go(func() {
		s.serveConsumer(takeCtx, s.sh.outbox, limit, func(msg jetstream.Msg) { s.redeliver(s.deliverCtx, msg) })
	})
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	s.stopStreams()
	stopTaking()
	starting.Wait()
	s.drain()
	loops.Wait()
	stopRenewing()
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.proxySrv.Shutdown(shutdownCtx)
	for _, t := range s.outbound {
		t.CloseIdleConnections()
	}
	if s.ownState {
		_ = s.sh.store.Close()
	}
	return serveErr
}

// errShutdown ends the deliveries still trying when shutdown gives up
// waiting for them.
var errShutdown = errors.New("the server shut down")

// drain waits DrainTimeout for the rollouts to finish, cancels those still
// running (they still report it), waits DrainTimeout again for their
// callbacks, then stops the deliveries: what is undelivered stays in the
// outbox, for another replica or the next start.
func (s *Service) drain() {
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	wait := func() bool {
		select {
		case <-done:
			return true
		case <-time.After(s.cfg.DrainTimeout):
			return false
		}
	}
	if !wait() {
		s.log.Warn("drain timeout: cancelling running rollouts", "active", s.store.counts())
		s.cancelRollouts()
		if !wait() {
			s.log.Error("drain timeout: leaving the callbacks still being delivered to the outbox", "active", s.store.counts())
			s.stopDelivery(errShutdown)
			<-done
			return
		}
	}
	s.stopDelivery(errShutdown)
}

// UnaryInterceptor enforces the API key on unary RPCs.
func (s *Service) UnaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	return s.auth.Unary(ctx, req, info, handler)
}

// StreamInterceptor enforces the API key on streaming RPCs.
func (s *Service) StreamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return s.auth.Stream(srv, ss, info, handler)
}
