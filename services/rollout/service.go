package rollout

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
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

	cfg        Config
	auth       *server.BearerAuth
	log        *slog.Logger
	store      *store
	logs       *eventLogs
	sem        chan struct{}
	routes     *llmproxy.RouteTable
	proxySrv   *http.Server
	proxyLn    net.Listener
	proxyURL   string
	llmClient  *http.Client
	httpClient *http.Client
	completed  atomic.Int64
	metrics    *metrics
	// g2Client posts the G2 callbacks; per-attempt timeouts come from the
	// policy.
	g2Client *http.Client

	// G2 admission: admitMu makes the capacity check and the admission one
	// step; wfSem is the workflow's own limit (nil when it has none).
	admitMu   sync.Mutex
	queuedG2  atomic.Int64
	runningG2 atomic.Int64
	wfSem     chan struct{}
	tracer    trace.Tracer // nil when not tracing
	// rejectSem bounds the refused starts reported through callbacks at
	// once (reportRejected).
	rejectSem chan struct{}

	// rolloutsCtx parents every rollout; cancelling it aborts them all.
	rolloutsCtx    context.Context
	cancelRollouts context.CancelFunc
	wg             sync.WaitGroup
}

// New validates cfg, opens the embedded LLM proxy's listener and returns a
// Service ready to accept rollouts. Serve runs its background work.
func New(cfg Config) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	logs, err := newEventLogs(cfg.LogDir, time.Now())
	if err != nil {
		return nil, err
	}
	s := &Service{
		cfg: cfg,
		// All RPCs need the key but Health (the Osmosis /health) and the
		// standard health and reflection services.
		auth:    server.NewBearerAuth(cfg.APIKey, rolloutv1.RolloutService_Health_FullMethodName),
		log:     cfg.Logger.With("service", "rollout"),
		store:   newStore(),
		logs:    logs,
		sem:     make(chan struct{}, cfg.MaxConcurrent),
		routes:  llmproxy.NewRouteTable(),
		metrics: newMetrics(cfg.Metrics),

		rejectSem: make(chan struct{}, maxRejectedDeliveries),
	}
	upstream := &http.Transport{
		Proxy:               nil,
		MaxConnsPerHost:     cfg.Client.MaxConnections,
		MaxIdleConnsPerHost: cfg.Client.MaxKeepaliveConnections,
		MaxIdleConns:        cfg.Client.MaxConnections,
		IdleConnTimeout:     90 * time.Second,
	}
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:   s.routes,
		Recorder: llmproxy.RecorderFunc(s.recordCall),
		Retry: llmproxy.RetryPolicy{
			MaxRetries: cfg.Client.MaxRetries,
			BaseDelay:  cfg.Client.RetryBaseDelay,
			MaxDelay:   cfg.Client.RetryMaxDelay,
		},
		Timeout:         cfg.Client.Timeout,
		Transport:       upstream,
		Logger:          cfg.Logger,
		RequireSampleID: true,
		Metrics:         cfg.Metrics,
		TracerProvider:  cfg.ProxyTracerProvider,
		Propagator:      cfg.Propagator,
		CaptureContent:  cfg.TraceContent,
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
	// Workflows reach the proxy over loopback; no client timeout here because
	// the proxy enforces per-attempt timeouts and the rollout context the rest.
	s.llmClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.MaxConcurrent, IdleConnTimeout: 90 * time.Second}}
	s.httpClient = cfg.HTTPClient
	if s.httpClient == nil {
		s.httpClient = &http.Client{Transport: &http.Transport{
			MaxConnsPerHost:     cfg.Client.MaxConnections,
			MaxIdleConnsPerHost: cfg.Client.MaxKeepaliveConnections,
			IdleConnTimeout:     90 * time.Second,
		}}
	}
	s.g2Client = s.httpClient
	if tp := cfg.TracerProvider; tp != nil {
		s.g2Client = tracedClient(s.httpClient, tp, cfg, "POST callback")
		s.tracer = tp.Tracer(tracerName)
		// Each LLM call and each callback attempt is a client span whose
		// trace context (and the ids' baggage) goes out in its headers.
		s.llmClient = tracedClient(s.llmClient, tp, cfg, "POST /r/{rollout_id}/s/{sample_id}/v1/chat/completions")
		s.httpClient = tracedClient(s.httpClient, tp, cfg, "POST /v1/rollout/completed")
	}
	if cfg.Workflow != nil {
		if n := cfg.Workflow.MaxConcurrent(); n > 0 && n < cfg.MaxConcurrent {
			s.wfSem = make(chan struct{}, n)
		}
	}
	s.rolloutsCtx, s.cancelRollouts = context.WithCancel(context.Background())
	return s, nil
}

// tracedClient is a copy of c whose requests are client spans named name.
func tracedClient(c *http.Client, tp trace.TracerProvider, cfg Config, name string) *http.Client {
	base := c.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	traced := *c
	traced.Transport = otelhttp.NewTransport(base,
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(cfg.Propagator),
		otelhttp.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelhttp.WithSpanNameFormatter(func(string, *http.Request) string { return name }))
	return &traced
}

// Close releases the embedded proxy's listener of a Service that will not
// Serve (Serve releases it itself).
func (s *Service) Close() error { return s.proxyLn.Close() }

// ProxyURL is the base URL of the embedded LLM proxy (http://127.0.0.1:PORT).
func (s *Service) ProxyURL() string { return s.proxyURL }

// Serve runs the embedded proxy and record pruning until ctx ends, then
// drains: running rollouts get DrainTimeout to finish, are then cancelled
// (and still deliver their completion), and Serve returns when all are done.
func (s *Service) Serve(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() {
		if err := s.proxySrv.Serve(s.proxyLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("rollout: proxy: %w", err)
		}
	}()
	tick := time.NewTicker(s.cfg.CleanupInterval)
	defer tick.Stop()
	var serveErr error
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case serveErr = <-errc:
			break loop
		case now := <-tick.C:
			if n := s.store.prune(now, s.cfg.RecordTTL); n > 0 {
				s.log.Debug("pruned finished rollouts", "count", n)
			}
		}
	}
	s.drain()
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.proxySrv.Shutdown(shutdownCtx)
	return serveErr
}

func (s *Service) drain() {
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	t := time.NewTimer(s.cfg.DrainTimeout)
	defer t.Stop()
	select {
	case <-done:
		return
	case <-t.C:
	}
	s.log.Warn("drain timeout: cancelling running rollouts", "active", s.store.counts())
	s.cancelRollouts()
	<-done
}

// InitRollout implements the G1 init.
func (s *Service) InitRollout(ctx context.Context, req *rolloutv1.InitRolloutRequest) (*rolloutv1.InitRolloutResponse, error) {
	if s.cfg.AgentLoop == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "this server runs the AgentWorkflow %q: start rollouts with POST /rollout (G2), not /v1/rollout/init", s.cfg.Workflow.Name())
	}
	if err := validateInit(req, s.cfg.MaxMetadataBytes); err != nil {
		s.metrics.rejected.WithLabelValues(rejectInvalid).Inc()
		return nil, err
	}
	key := req.GetRolloutId()
	if req.IdempotencyKey != nil {
		key = req.GetIdempotencyKey()
	}
	rec := &record{
		id:       req.GetRolloutId(),
		key:      key,
		sampleID: s.cfg.AgentLoop.Name(),
		workflow: s.cfg.AgentLoop.Name(),
		req:      req,
		metadata: req.GetMetadata(),
		label:    label(req),
		ready:    make(chan struct{}),
		state:    rolloutv1.State_STATE_QUEUED,
		created:  time.Now(),
	}
	existing, dup, ok := s.store.admit(rec)
	if !ok {
		return nil, status.Errorf(codes.AlreadyExists, "rollout_id %q is already in use under another idempotency key", rec.id)
	}
	if dup {
		select {
		case <-existing.ready:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		if existing.initErr != nil {
			// The first init failed and cleared its record; this one may retry.
			return s.InitRollout(ctx, req)
		}
		return existing.initResp, nil
	}
	log := s.log.With("rollout_id", rec.id, "sample_id", rec.sampleID)
	rec.log = s.logs.open(rec.id)
	rec.initContexts(s.rolloutsCtx)

	resp, err := s.initTools(rec)
	if err != nil {
		rec.initErr = err
		s.store.forget(rec)
		close(rec.ready)
		_ = rec.log.close()
		log.ErrorContext(ctx, "init failed", "error", err)
		return nil, status.Error(codes.Internal, err.Error())
	}
	rec.initResp = resp
	s.startRollout(ctx, rec)
	close(rec.ready)
	rec.log.write("init", map[string]any{"num_messages": len(req.GetMessages()), "num_tools": len(resp.GetTools())})
	log.InfoContext(ctx, "rollout accepted", "tools", len(resp.GetTools()))
	s.metrics.started.Inc()
	s.metrics.queued.Inc()

	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.run(rec)
	}()
	return resp, nil
}

// GetRollout returns a rollout's current record.
func (s *Service) GetRollout(_ context.Context, req *rolloutv1.GetRolloutRequest) (*rolloutv1.Rollout, error) {
	if req.GetRolloutId() == "" {
		return nil, badField("rollout_id", "required")
	}
	rec := s.store.get(req.GetRolloutId())
	if rec == nil {
		return nil, status.Errorf(codes.NotFound, "rollout %q not found", req.GetRolloutId())
	}
	return rec.proto(), nil
}

// watchBuffer is how many finished rollouts a watcher may lag behind.
const watchBuffer = 1024

// WatchRollouts streams finished rollouts.
func (s *Service) WatchRollouts(req *rolloutv1.WatchRolloutsRequest, stream grpc.ServerStreamingServer[rolloutv1.Rollout]) error {
	if req.GetAfterSequence() < -1 {
		return badField("after_sequence", "must be -1 or more, got %d", req.GetAfterSequence())
	}
	replay, sub := s.store.subscribe(req.GetAfterSequence(), watchBuffer)
	defer s.store.unsubscribe(sub)
	last := req.GetAfterSequence()
	for _, rec := range replay {
		if err := stream.Send(rec.proto()); err != nil {
			return err
		}
		last = rec.sequence()
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case rec, ok := <-sub.ch:
			if !ok {
				return status.Errorf(codes.ResourceExhausted, "watcher fell behind; reconnect with after_sequence=%d", last)
			}
			if rec.sequence() <= last {
				continue // already replayed
			}
			if err := stream.Send(rec.proto()); err != nil {
				return err
			}
			last = rec.sequence()
		}
	}
}

// Health answers the Osmosis health body.
func (s *Service) Health(context.Context, *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	resp := &rolloutv1.HealthResponse{
		Status:            "healthy",
		ActiveRollouts:    int32(s.store.counts()),
		CompletedRollouts: int32(s.completed.Load()),
	}
	if s.cfg.AgentLoop != nil {
		resp.AgentLoop = s.cfg.AgentLoop.Name()
	}
	if wf := s.cfg.Workflow; wf != nil {
		// The G3 body: a G2 server answers "ok" with its concurrency.
		limit := s.cfg.MaxConcurrent
		if n := wf.MaxConcurrent(); n > 0 && n < limit {
			limit = n
		}
		if resp.AgentLoop == "" {
			resp.Status, resp.AgentLoop = "ok", wf.Name()
		}
		resp.Concurrency = &rolloutv1.Concurrency{
			MaxConcurrent: int32(limit),
			Queued:        int32(s.queuedG2.Load()),
			Running:       int32(s.runningG2.Load()),
		}
	}
	return resp, nil
}

// PlatformHealth is Health behind the API key (checked by the interceptor);
// without a configured key the route does not exist.
func (s *Service) PlatformHealth(ctx context.Context, req *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	if s.cfg.APIKey == "" {
		return nil, status.Error(codes.NotFound, "Not Found")
	}
	return s.Health(ctx, req)
}

// UnaryInterceptor enforces the API key on unary RPCs.
func (s *Service) UnaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	return s.auth.Unary(ctx, req, info, handler)
}

// StreamInterceptor enforces the API key on streaming RPCs.
func (s *Service) StreamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return s.auth.Stream(srv, ss, info, handler)
}
