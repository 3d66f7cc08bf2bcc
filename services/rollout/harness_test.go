package rollout_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/gateway"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/services/rollout"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// harness runs a rollout service over real gRPC, with the gateway's REST
// face in front of it, a policy (mockllm unless the test brings its own),
// and a trainer of each wire generation: a G1 controller (g1), a G2 one
// (g2) and a v0.3 one (v03), each forwarding the LLM calls it is sent to
// the policy. Everything listens on loopback and stops with the test.
type harness struct {
	svc    *rollout.Service
	client rolloutv1.RolloutServiceClient
	// rest is the gateway's base URL: what a trainer posts to.
	rest   string
	policy *httptest.Server
	g1     *controller.Controller
	g2     *controller.G2
	v03    *controller.V03
	cancel context.CancelFunc
	done   chan struct{}
}

type harnessOpts struct {
	// wf is the workflow the service runs; without one (and without an
	// AgentLoop set by cfg) it runs the calculator agent loop.
	wf  *osmo.Workflow
	cfg func(*rollout.Config)
	// The trainers' options; their policy URLs are the harness's.
	g1  controller.Options
	g2  controller.G2Options
	v03 controller.V03Options
	// mock configures mockllm; policy, when set, replaces it.
	mock   mockllm.Options
	policy http.Handler
	// grpcServer and grpcDial add options to the service's gRPC server and
	// the test's connection to it (tracing, say).
	grpcServer []grpc.ServerOption
	grpcDial   []grpc.DialOption
	// share, when set, gives this harness the policy and trainers of
	// another (a restarted service talking to the same trainers); the
	// options above for them are ignored.
	share *harness
}

// Keys of the harness's trainers.
const (
	g1Key       = "g1-key"
	g2CtlKey    = "ctl-key"
	v03CtlKey   = "v03-callback-key"
	v03LLMKey   = "v03-llm-key"
	testTimeout = 8 * time.Second
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newHarness(t *testing.T, o harnessOpts) *harness {
	t.Helper()
	h := &harness{done: make(chan struct{})}
	if o.share != nil {
		h.policy, h.g1, h.g2, h.v03 = o.share.policy, o.share.g1, o.share.g2, o.share.v03
	} else {
		h.startTrainers(t, o)
	}
	h.startService(t, o)
	return h
}

// startTrainers starts the policy and the trainers of every wire.
func (h *harness) startTrainers(t *testing.T, o harnessOpts) {
	t.Helper()
	policy := o.policy
	if policy == nil {
		if o.mock.Logger == nil {
			o.mock.Logger = quietLogger()
		}
		m, err := mockllm.New(o.mock)
		if err != nil {
			t.Fatal(err)
		}
		policy = m
	}
	h.policy = httptest.NewServer(policy)
	t.Cleanup(h.policy.Close)
	policyURL := h.policy.URL + "/v1"

	var err error
	o.g1.PolicyURL, o.g1.Logger = policyURL, quietLogger()
	if h.g1, err = controller.New("127.0.0.1:0", o.g1); err != nil {
		t.Fatal(err)
	}
	o.g2.PolicyURL, o.g2.Logger = policyURL, quietLogger()
	if o.g2.APIKey == "" {
		o.g2.APIKey = g2CtlKey
	}
	if h.g2, err = controller.NewG2("127.0.0.1:0", o.g2); err != nil {
		t.Fatal(err)
	}
	o.v03.PolicyURL, o.v03.Logger = policyURL, quietLogger()
	if o.v03.CallbackKey == "" {
		o.v03.CallbackKey = v03CtlKey
	}
	if h.v03, err = controller.NewV03("127.0.0.1:0", o.v03); err != nil {
		t.Fatal(err)
	}
	// The trainers outlive the service so callbacks posted while it
	// drains are still received.
	ctlCtx, stopCtl := context.WithCancel(context.Background())
	var ctlWG sync.WaitGroup
	for _, serve := range []func(context.Context) error{h.g1.Serve, h.g2.Serve, h.v03.Serve} {
		ctlWG.Add(1)
		go func() { defer ctlWG.Done(); _ = serve(ctlCtx) }()
	}
	t.Cleanup(func() { stopCtl(); ctlWG.Wait() })
}

// startService starts the rollout service, its gRPC server and the
// gateway.
func (h *harness) startService(t *testing.T, o harnessOpts) {
	t.Helper()
	var err error

	cfg := rollout.Config{
		Workflow: o.wf,
		Logger:   quietLogger(),
		// As served: the proxy asks the policy for tokens.
		Rows: true,
		Client: rollout.ClientSettings{
			Timeout:        5 * time.Second,
			MaxRetries:     1,
			RetryBaseDelay: 10 * time.Millisecond,
			RetryMaxDelay:  50 * time.Millisecond,
		},
		Callbacks: rollout.CallbackSettings{
			BaseDelay: 10 * time.Millisecond,
			MaxDelay:  40 * time.Millisecond,
			Timeout:   2 * time.Second,
			Deadline:  3 * time.Second,
		},
		RolloutTimeout: 5 * time.Second,
		GradeTimeout:   5 * time.Second,
		DrainTimeout:   500 * time.Millisecond,
	}
	if o.cfg != nil {
		o.cfg(&cfg)
	}
	if cfg.Workflow == nil && cfg.AgentLoop == nil {
		cfg.AgentLoop = calculator.Loop{}
	}
	h.svc, err = rollout.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := server.NewGRPC("127.0.0.1:0", append(o.grpcServer,
		grpc.ChainUnaryInterceptor(h.svc.UnaryInterceptor), grpc.ChainStreamInterceptor(h.svc.StreamInterceptor))...)
	if err != nil {
		t.Fatal(err)
	}
	rolloutv1.RegisterRolloutServiceServer(srv, h.svc)
	conn, err := grpc.NewClient(srv.Addr(), append(o.grpcDial, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	h.client = rolloutv1.NewRolloutServiceClient(conn)
	gw, err := gateway.New(gateway.Config{Rollout: conn, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	gwLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.rest = "http://" + gwLn.Addr().String()
	gwSrv := &http.Server{Handler: gw, ReadHeaderTimeout: 5 * time.Second}

	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { defer wg.Done(); _ = h.svc.Serve(ctx) }()
	go func() { defer wg.Done(); _ = srv.Serve(ctx) }()
	go func() {
		defer wg.Done()
		go func() {
			<-ctx.Done()
			sctx, c := context.WithTimeout(context.Background(), 2*time.Second)
			defer c()
			_ = gwSrv.Shutdown(sctx)
		}()
		_ = gwSrv.Serve(gwLn)
	}()
	go func() { wg.Wait(); close(h.done) }()
	// Cleanups run last-registered first: the service stops before the
	// trainers it posts callbacks to.
	t.Cleanup(func() {
		_ = conn.Close()
		h.stop(t)
	})
}

// stop shuts the service down and waits (bounded) for it.
func (h *harness) stop(t *testing.T) {
	h.cancel()
	select {
	case <-h.done:
	case <-time.After(20 * time.Second):
		t.Error("harness did not shut down in 20s")
	}
}

func mustStruct(t *testing.T, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// initReq builds a valid G1 init for the calculator task "What is a * b?",
// addressed to the harness's G1 trainer.
func (h *harness) initReq(t *testing.T, id string, a, b int, groundTruth any) *rolloutv1.InitRolloutRequest {
	t.Helper()
	req := &rolloutv1.InitRolloutRequest{
		RolloutId:        id,
		ServerUrl:        h.g1.URL(),
		Messages:         []*structpb.Struct{mustStruct(t, map[string]any{"role": "user", "content": fmt.Sprintf("What is %d * %d?", a, b)})},
		CompletionParams: mustStruct(t, map[string]any{"temperature": 1.0}),
	}
	if groundTruth != nil {
		req.Metadata = mustStruct(t, map[string]any{"ground_truth": groundTruth})
	}
	return req
}

// waitG1 waits for the G1 completion of id.
func (h *harness) waitG1(t *testing.T, id string) controller.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := h.g1.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// startReq is a valid G2 start for "What is 6 times 7?" addressed to the
// harness's G2 trainer, with a grader callback, its key and label
// "forty-two" (which appears in nothing the workflow could see, so its
// absence there is checkable).
func (h *harness) startReq(t *testing.T, id string) *rolloutv1.StartRolloutRequest {
	t.Helper()
	return &rolloutv1.StartRolloutRequest{
		RolloutId:             id,
		InitialMessages:       []*structpb.Struct{mustStruct(t, map[string]any{"role": "user", "content": "What is 6 times 7?"})},
		ChatCompletionsUrl:    h.g2.ChatCompletionsURL(),
		CompletionCallbackUrl: h.g2.CompletionURL(),
		GraderCallbackUrl:     proto.String(h.g2.GraderURL()),
		Label:                 structpb.NewStringValue("forty-two"),
		Metadata:              mustStruct(t, map[string]any{"difficulty": "easy"}),
		ControllerApiKey:      proto.String(g2CtlKey),
	}
}

func (h *harness) start(t *testing.T, req *rolloutv1.StartRolloutRequest) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := h.client.StartRollout(ctx, req); err != nil {
		t.Fatalf("StartRollout(%s): %v", req.GetRolloutId(), err)
	}
}

func (h *harness) waitCompletion(t *testing.T, id string) controller.G2Callback {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	c, err := h.g2.WaitCompletion(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (h *harness) waitGrader(t *testing.T, id string) controller.G2Callback {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	c, err := h.g2.WaitGrader(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitDone polls GetRollout until the rollout finished (its callbacks are
// then delivered or given up on) and returns it.
func (h *harness) waitDone(t *testing.T, id string) *rolloutv1.Rollout {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		r, err := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: id})
		if err == nil && r.GetFinishedAt() != nil {
			return r
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("rollout %s did not finish in 15s", id)
	return nil
}

func (h *harness) status(t *testing.T, id string) *rolloutv1.RolloutStatus {
	t.Helper()
	st, err := h.client.GetRolloutStatus(context.Background(), &rolloutv1.GetRolloutStatusRequest{RolloutId: id})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func (h *harness) health(t *testing.T) *rolloutv1.HealthResponse {
	t.Helper()
	hr, err := h.client.Health(context.Background(), &rolloutv1.HealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return hr
}

// waitHealth polls Health until ok accepts it.
func (h *harness) waitHealth(t *testing.T, what string, ok func(*rolloutv1.Concurrency) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	var last *rolloutv1.HealthResponse
	for time.Now().Before(deadline) {
		last = h.health(t)
		if ok(last.GetConcurrency()) {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("health never showed %s; last %v", what, last)
}

// mockOpts makes every policy call fail the given way.
func mockOpts(fail string) mockllm.Options {
	return mockllm.Options{FailMode: fail, FailEvery: 1, Logger: quietLogger()}
}

// fakeGrader answers from a function and counts calls.
type fakeGrader struct {
	mu    sync.Mutex
	calls int
	fn    func(*graderv1.GradeRequest) (*graderv1.GradeResponse, error)
}

func (g *fakeGrader) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	g.mu.Lock()
	g.calls++
	g.mu.Unlock()
	return g.fn(req)
}

func (g *fakeGrader) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.calls
}
