package gateway_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo/gateway"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/internal/telemetry"
)

// testTimeout bounds every test's traffic.
const testTimeout = 10 * time.Second

// apiKey is what fakeRollout.InitRollout wants when requireKey is set.
const apiKey = "Bearer secret"

// recorder keeps the incoming metadata of the last call to each method.
type recorder struct {
	mu sync.Mutex
	md map[string]metadata.MD
}

func (r *recorder) record(ctx context.Context, method string) {
	md, _ := metadata.FromIncomingContext(ctx)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.md == nil {
		r.md = map[string]metadata.MD{}
	}
	r.md[method] = md.Copy()
}

// last returns the metadata of the last call to method (full gRPC name).
func (r *recorder) last(t *testing.T, method string) metadata.MD {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	md, ok := r.md[method]
	if !ok {
		t.Fatalf("%s was not called", method)
	}
	return md
}

func (r *recorder) called(method string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.md[method]
	return ok
}

// fakeRollout is a canned RolloutService. Its fields are set before the
// server starts; the last requests are kept under mu.
type fakeRollout struct {
	rolloutv1.UnimplementedRolloutServiceServer

	requireKey bool             // InitRollout wants apiKey
	errs       map[string]error // GetRollout answers errs[rollout_id] when set
	watch      []*rolloutv1.Rollout
	watchErr   error
	// StreamRows: rowsAtOnce fails the request before its headers;
	// otherwise headers are sent, rowsHold (when set) is waited for, then
	// rows are sent and rowsErr ends the stream.
	rows       []*rolloutv1.Row
	rowsErr    error
	rowsAtOnce error
	rowsHold   chan struct{}

	mu        sync.Mutex
	lastInit  *rolloutv1.InitRolloutRequest
	lastWatch *rolloutv1.WatchRolloutsRequest
	lastRows  *rolloutv1.StreamRowsRequest
}

func (f *fakeRollout) InitRollout(ctx context.Context, req *rolloutv1.InitRolloutRequest) (*rolloutv1.InitRolloutResponse, error) {
	if f.requireKey {
		md, _ := metadata.FromIncomingContext(ctx)
		if got := md.Get("authorization"); len(got) != 1 || got[0] != apiKey {
			return nil, status.Error(codes.Unauthenticated, "Invalid or missing API key")
		}
	}
	f.mu.Lock()
	f.lastInit = proto.Clone(req).(*rolloutv1.InitRolloutRequest)
	f.mu.Unlock()
	tool, err := structpb.NewStruct(map[string]any{
		"type": "function",
		"function": map[string]any{
			"name":        "add",
			"description": "Add two numbers.",
			"parameters": map[string]any{
				"type":       "object",
				"properties": map[string]any{"a": map[string]any{"type": "number"}},
				"required":   []any{"a"},
			},
		},
	})
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &rolloutv1.InitRolloutResponse{RolloutId: req.GetRolloutId(), Tools: []*structpb.Struct{tool}}, nil
}

func (f *fakeRollout) init() *rolloutv1.InitRolloutRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastInit
}

func (f *fakeRollout) GetRollout(ctx context.Context, req *rolloutv1.GetRolloutRequest) (*rolloutv1.Rollout, error) {
	// Metadata a REST client must never see.
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-internal", "header-secret"))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-internal-trailer", "trailer-secret"))
	if err := f.errs[req.GetRolloutId()]; err != nil {
		return nil, err
	}
	r := &rolloutv1.Rollout{
		RolloutId:    req.GetRolloutId(),
		State:        rolloutv1.State_STATE_SUCCEEDED,
		Workflow:     "echo",
		FinishReason: "stop",
		Sequence:     3,
		Metrics:      &rolloutv1.RolloutMetrics{NumLlmCalls: 2},
	}
	if req.GetRolloutId() == "graded" {
		r.Reward = proto.Float64(0.5)
	}
	return r, nil
}

func (f *fakeRollout) WatchRollouts(req *rolloutv1.WatchRolloutsRequest, stream grpc.ServerStreamingServer[rolloutv1.Rollout]) error {
	f.mu.Lock()
	f.lastWatch = proto.Clone(req).(*rolloutv1.WatchRolloutsRequest)
	f.mu.Unlock()
	for _, r := range f.watch {
		if err := stream.Send(r); err != nil {
			return err
		}
	}
	return f.watchErr
}

func (f *fakeRollout) StreamRows(req *rolloutv1.StreamRowsRequest, stream grpc.ServerStreamingServer[rolloutv1.Row]) error {
	f.mu.Lock()
	f.lastRows = proto.Clone(req).(*rolloutv1.StreamRowsRequest)
	f.mu.Unlock()
	if f.rowsAtOnce != nil {
		return f.rowsAtOnce
	}
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	if f.rowsHold != nil {
		select {
		case <-f.rowsHold:
		case <-stream.Context().Done():
			return nil
		}
	}
	for _, r := range f.rows {
		if err := stream.Send(r); err != nil {
			return err
		}
	}
	return f.rowsErr
}

func (f *fakeRollout) rowsRequest() *rolloutv1.StreamRowsRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastRows
}

func (f *fakeRollout) watchRequest() *rolloutv1.WatchRolloutsRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastWatch
}

// GetRolloutStatus answers "queued" with nothing else set, except for
// "failed", which has every field.
func (f *fakeRollout) GetRolloutStatus(_ context.Context, req *rolloutv1.GetRolloutStatusRequest) (*rolloutv1.RolloutStatus, error) {
	st := &rolloutv1.RolloutStatus{RolloutId: req.GetRolloutId(), Status: "queued"}
	if req.GetRolloutId() == "failed" {
		st.Status, st.Reward, st.ErrMessage, st.ErrCategory = "failure", proto.Float64(0), proto.String("grading failed"), proto.String("agent_error")
	}
	return st, nil
}

func (f *fakeRollout) Health(context.Context, *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	return &rolloutv1.HealthResponse{Status: "healthy", AgentLoop: "echo", ActiveRollouts: 3, CompletedRollouts: 7}, nil
}

func (f *fakeRollout) PlatformHealth(context.Context, *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	return nil, status.Error(codes.NotFound, "Not Found")
}

// fakeGrader rewards every sample 1.0 and echoes the grader name.
type fakeGrader struct {
	graderv1.UnimplementedGraderServiceServer
}

func grade(req *graderv1.GradeRequest) *graderv1.GradeResponse {
	resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: req.GetGrader()}
	for _, s := range samplesOf(req) {
		resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: s.GetId(), Reward: proto.Float64(1)})
	}
	return resp
}

func (fakeGrader) Grade(_ context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	if req.GetRolloutId() == "" {
		return nil, status.Error(codes.InvalidArgument, "rollout_id: required")
	}
	return grade(req), nil
}

func (fakeGrader) GradeStream(stream grpc.BidiStreamingServer[graderv1.GradeRequest, graderv1.GradeResponse]) error {
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if req.GetRolloutId() == "poison" {
			return status.Error(codes.FailedPrecondition, "poisoned sample")
		}
		if err := stream.Send(grade(req)); err != nil {
			return err
		}
	}
}

// harness runs the fakes on a real gRPC server and the gateway in front of
// them, twice: on httptest (HTTP/1.1) for REST, and on an http.Server that
// also speaks cleartext HTTP/2 for gRPC.
type harness struct {
	rollout *fakeRollout
	md      *recorder

	restURL string // httptest, HTTP/1.1
	h2cURL  string // HTTP/1.1 and h2c
	h2cAddr string
	client  *http.Client // HTTP/1.1
	h2c     *http.Client // HTTP/2 with prior knowledge, for gRPC
}

type harnessOption func(*harnessConfig)

type harnessConfig struct {
	noGrader     bool
	maxBodyBytes int64
	logger       *slog.Logger
	tracer       trace.TracerProvider
	rootMux      bool
}

// withRootMux mounts the gateway at "/" of an http.ServeMux, as osmo serves
// it (behind GET /metrics): requests reach it with Pattern "/".
func withRootMux() harnessOption { return func(c *harnessConfig) { c.rootMux = true } }

// withTracing traces the gateway and its connection through tp.
func withTracing(tp trace.TracerProvider) harnessOption {
	return func(c *harnessConfig) { c.tracer = tp }
}

func withLogger(l *slog.Logger) harnessOption { return func(c *harnessConfig) { c.logger = l } }

func withoutGrader() harnessOption { return func(c *harnessConfig) { c.noGrader = true } }

func withMaxBodyBytes(n int64) harnessOption {
	return func(c *harnessConfig) { c.maxBodyBytes = n }
}

func newHarness(t *testing.T, rollout *fakeRollout, opts ...harnessOption) *harness {
	t.Helper()
	var hc harnessConfig
	for _, o := range opts {
		o(&hc)
	}
	if rollout == nil {
		rollout = &fakeRollout{}
	}
	rec := &recorder{}

	srv := grpc.NewServer(
		grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			rec.record(ctx, info.FullMethod)
			return handler(ctx, req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			rec.record(ss.Context(), info.FullMethod)
			return handler(srv, ss)
		}),
	)
	rolloutv1.RegisterRolloutServiceServer(srv, rollout)
	graderv1.RegisterGraderServiceServer(srv, fakeGrader{})
	healthSrv := health.NewServer()
	healthSrv.SetServingStatus("", grpc_health_v1.HealthCheckResponse_SERVING)
	healthSrv.SetServingStatus("osmo.grader.v1.GraderService", grpc_health_v1.HealthCheckResponse_NOT_SERVING)
	grpc_health_v1.RegisterHealthServer(srv, healthSrv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})

	conn, err := grpc.NewClient(ln.Addr().String(), append(telemetry.GRPCDialOptions(hc.tracer, nil), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })

	cfg := gateway.Config{
		Rollout:        conn,
		Grader:         conn,
		MaxBodyBytes:   hc.maxBodyBytes,
		Logger:         slog.New(slog.DiscardHandler),
		TracerProvider: hc.tracer,
	}
	if hc.logger != nil {
		cfg.Logger = hc.logger
	}
	if hc.noGrader {
		cfg.Grader = nil
	}
	handler, err := gateway.New(cfg)
	if err != nil {
		t.Fatalf("gateway.New: %v", err)
	}
	if hc.rootMux {
		mux := http.NewServeMux()
		mux.Handle("/", handler)
		handler = mux
	}

	rest := httptest.NewServer(handler)
	t.Cleanup(rest.Close)

	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	h2cServer := &http.Server{Handler: handler, Protocols: &protocols, ReadHeaderTimeout: testTimeout}
	h2cLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	h2cServed := make(chan struct{})
	go func() {
		defer close(h2cServed)
		_ = h2cServer.Serve(h2cLn)
	}()
	t.Cleanup(func() {
		_ = h2cServer.Close()
		<-h2cServed
	})

	var clientProtocols http.Protocols
	clientProtocols.SetUnencryptedHTTP2(true)
	h2cTransport := &http.Transport{Protocols: &clientProtocols}
	t.Cleanup(h2cTransport.CloseIdleConnections)
	client := rest.Client()
	client.Timeout = testTimeout

	return &harness{
		rollout: rollout,
		md:      rec,
		restURL: rest.URL,
		h2cURL:  "http://" + h2cLn.Addr().String(),
		h2cAddr: h2cLn.Addr().String(),
		client:  client,
		h2c:     &http.Client{Transport: h2cTransport, Timeout: testTimeout},
	}
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// samplesOf is the samples of a grade request, read as the API's
// messages, whichever form it carries them in.
func samplesOf(req *graderv1.GradeRequest) []*rolloutv1.RolloutSample {
	if len(req.GetSamplesJson()) == 0 {
		return req.GetSamples()
	}
	var r graderv1.GradeRequest
	b := append(append([]byte(`{"samples":`), req.GetSamplesJson()...), '}')
	if err := sample.FromJSON(b, &r); err != nil {
		panic(err)
	}
	return r.GetSamples()
}
