package rollout_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/services/rollout"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// harness runs a rollout service over real gRPC, a mock policy and a G1
// controller, all on loopback.
type harness struct {
	svc    *rollout.Service
	client rolloutv1.RolloutServiceClient
	ctl    *controller.Controller
	mock   *httptest.Server
	cancel context.CancelFunc
	done   chan struct{}
}

type harnessOpts struct {
	cfg  func(*rollout.Config)
	ctl  controller.Options
	mock mockllm.Options
	// grpcServer and grpcDial add options to the service's gRPC server and
	// the test's connection to it (tracing, say).
	grpcServer []grpc.ServerOption
	grpcDial   []grpc.DialOption
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newHarness(t *testing.T, o harnessOpts) *harness {
	t.Helper()
	h := &harness{done: make(chan struct{})}
	mock, err := mockllm.New(o.mock)
	if err != nil {
		t.Fatal(err)
	}
	h.mock = httptest.NewServer(mock)
	t.Cleanup(h.mock.Close)

	o.ctl.PolicyURL = h.mock.URL + "/v1"
	if o.ctl.Logger == nil {
		o.ctl.Logger = quietLogger()
	}
	h.ctl, err = controller.New("127.0.0.1:0", o.ctl)
	if err != nil {
		t.Fatal(err)
	}
	cfg := rollout.Config{
		AgentLoop: calculator.Loop{},
		Logger:    quietLogger(),
		Client: rollout.ClientSettings{
			Timeout:                5 * time.Second,
			MaxRetries:             1,
			CompleteRolloutRetries: 2,
			RetryBaseDelay:         10 * time.Millisecond,
			RetryMaxDelay:          50 * time.Millisecond,
		},
		DrainTimeout: 2 * time.Second,
	}
	if o.cfg != nil {
		o.cfg(&cfg)
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
	// The controller outlives the service so completions posted while the
	// service drains are still received.
	ctlCtx, stopCtl := context.WithCancel(context.Background())
	ctlDone := make(chan struct{})
	go func() { defer close(ctlDone); _ = h.ctl.Serve(ctlCtx) }()
	t.Cleanup(func() { stopCtl(); <-ctlDone })
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = h.svc.Serve(ctx) }()
	go func() { defer wg.Done(); _ = srv.Serve(ctx) }()
	go func() { wg.Wait(); close(h.done) }()
	conn, err := grpc.NewClient(srv.Addr(), append(o.grpcDial, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	h.client = rolloutv1.NewRolloutServiceClient(conn)
	// Cleanups run last-registered first: the service stops before the
	// controller it posts completions to.
	t.Cleanup(func() {
		_ = conn.Close()
		h.stop(t)
	})
	return h
}

// stop shuts everything down and waits (bounded) for it.
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

// initReq builds a valid G1 init for the calculator task "What is a * b?".
func (h *harness) initReq(t *testing.T, id string, a, b int, groundTruth any) *rolloutv1.InitRolloutRequest {
	t.Helper()
	req := &rolloutv1.InitRolloutRequest{
		RolloutId:        id,
		ServerUrl:        h.ctl.URL(),
		Messages:         []*structpb.Struct{mustStruct(t, map[string]any{"role": "user", "content": fmt.Sprintf("What is %d * %d?", a, b)})},
		CompletionParams: mustStruct(t, map[string]any{"temperature": 1.0}),
	}
	if groundTruth != nil {
		req.Metadata = mustStruct(t, map[string]any{"ground_truth": groundTruth})
	}
	return req
}

func (h *harness) wait(t *testing.T, id string) controller.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := h.ctl.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitState polls GetRollout until the rollout reaches a final state.
func (h *harness) waitFinished(t *testing.T, id string) *rolloutv1.Rollout {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		r, err := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: id})
		if err == nil && r.GetFinishedAt() != nil {
			return r
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("rollout %s did not finish", id)
	return nil
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
