package einoagent_test

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	einoagent "github.com/osmo-rl/osmo/examples/eino-agent"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/services/grader"
	"github.com/osmo-rl/osmo/services/rollout"
)

// ctlKey is the controller_api_key of the served stack.
const ctlKey = "ctl-key"

// served is the eino workflow behind the real rollout service, graded by
// the real grader service, with a G2 controller in front relaying LLM
// calls to mockllm: policy <- controller <- rollout service -> grader
// service, every hop over loopback.
type served struct {
	ctl    *controller.G2
	client rolloutv1.RolloutServiceClient
}

// serve starts the stack; the test's cleanup stops it in reverse order
// (rollout service, grader, controller), so callbacks posted while the
// rollout service drains are still received and graded.
func serve(t *testing.T) *served {
	t.Helper()
	logger := quietLogger()

	mock, err := mockllm.New(mockllm.Options{Logger: logger})
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	policy := httptest.NewServer(mock)
	t.Cleanup(policy.Close)

	ctl, err := controller.NewG2("127.0.0.1:0", controller.G2Options{PolicyURL: policy.URL + "/v1", APIKey: ctlKey, Logger: logger})
	if err != nil {
		t.Fatalf("controller.NewG2: %v", err)
	}
	goUntilCleanup(t, func(ctx context.Context) { _ = ctl.Serve(ctx) })

	gradeClient := startGrader(t)

	svc, err := rollout.New(rollout.Config{
		Workflow:   einoagent.New(),
		Grader:     gradeClient,
		GraderName: "multiply",
		Logger:     logger,
		Callbacks: rollout.CallbackSettings{
			BaseDelay: 10 * time.Millisecond,
			MaxDelay:  50 * time.Millisecond,
			Timeout:   5 * time.Second,
			Deadline:  time.Second,
		},
		RolloutTimeout: runTimeout,
		GradeTimeout:   runTimeout,
		DrainTimeout:   time.Second,
	})
	if err != nil {
		t.Fatalf("rollout.New: %v", err)
	}
	srv, err := server.NewGRPC("127.0.0.1:0",
		grpc.ChainUnaryInterceptor(svc.UnaryInterceptor), grpc.ChainStreamInterceptor(svc.StreamInterceptor))
	if err != nil {
		t.Fatalf("server.NewGRPC: %v", err)
	}
	rolloutv1.RegisterRolloutServiceServer(srv, svc)
	goUntilCleanup(t, func(ctx context.Context) {
		var wg sync.WaitGroup
		wg.Go(func() { _ = svc.Serve(ctx) })
		wg.Go(func() { _ = srv.Serve(ctx) })
		wg.Wait()
	})

	conn, err := grpc.NewClient(srv.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial the rollout service: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &served{ctl: ctl, client: rolloutv1.NewRolloutServiceClient(conn)}
}

// startGrader serves the built-in multiply grader over gRPC and returns a
// client of it, connected.
func startGrader(t *testing.T) *grader.Client {
	t.Helper()
	multiply, err := graders.Lookup("multiply")
	if err != nil {
		t.Fatalf("graders.Lookup: %v", err)
	}
	state, err := natsstore.Open(t.Context(), natsstore.Config{Logger: quietLogger()})
	if err != nil {
		t.Fatalf("natsstore.Open: %v", err)
	}
	t.Cleanup(func() { _ = state.Close() })
	gsvc, err := grader.New(t.Context(), grader.Config{
		Graders: map[string]osmo.Grader{"multiply": multiply},
		Default: "multiply",
		Timeout: runTimeout,
		State:   state,
		Logger:  quietLogger(),
	})
	if err != nil {
		t.Fatalf("grader.New: %v", err)
	}
	t.Cleanup(func() {
		if err := gsvc.Close(); err != nil {
			t.Errorf("grader service Close: %v", err)
		}
	})
	srv, err := server.NewGRPC("127.0.0.1:0")
	if err != nil {
		t.Fatalf("server.NewGRPC: %v", err)
	}
	graderv1.RegisterGraderServiceServer(srv, gsvc)
	goUntilCleanup(t, func(ctx context.Context) { _ = srv.Serve(ctx) })

	conn, err := grpc.NewClient(srv.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial the grader service: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := grader.NewClient(conn, grader.ClientOptions{Logger: quietLogger()})
	goUntilCleanup(t, func(ctx context.Context) { _ = client.Run(ctx) })
	return client
}

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// goUntilCleanup runs fn in a goroutine until the test's cleanup, which
// cancels fn's context and waits (bounded) for it to return.
func goUntilCleanup(t *testing.T, fn func(ctx context.Context)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Error("a server of the stack did not stop within 20s of its cleanup")
		}
	})
}

// TestServedByTheRolloutService runs the eino workflow as a G2 trainer
// would: one rollout started over gRPC, its LLM calls relayed by the
// controller, its sample graded by the grader service and posted back.
func TestServedByTheRolloutService(t *testing.T) {
	s := serve(t)
	const id = "eino-served-1"
	label, err := structpb.NewValue("42")
	if err != nil {
		t.Fatal(err)
	}
	user, err := structpb.NewStruct(map[string]any{"role": "user", "content": task})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.client.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
		RolloutId:             id,
		InitialMessages:       []*structpb.Struct{user},
		ChatCompletionsUrl:    s.ctl.ChatCompletionsURL(),
		CompletionCallbackUrl: s.ctl.CompletionURL(),
		GraderCallbackUrl:     proto.String(s.ctl.GraderURL()),
		Label:                 label,
		ControllerApiKey:      proto.String(ctlKey),
		AgentTimeoutSec:       proto.Float64(runTimeout.Seconds()),
	}); err != nil {
		t.Fatalf("StartRollout: %v", err)
	}

	wctx, wcancel := context.WithTimeout(context.Background(), runTimeout)
	defer wcancel()
	comp, err := s.ctl.WaitCompletion(wctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if comp.Status != "success" || comp.ErrMessage != nil || comp.ErrCategory != nil {
		t.Fatalf("completion %s, want success", comp.Raw)
	}
	grade, err := s.ctl.WaitGrader(wctx, id)
	if err != nil {
		t.Fatal(err)
	}
	sample, ok := grade.Samples[einoagent.AgentName]
	if grade.Status != "success" || !ok || len(grade.Samples) != 1 {
		t.Fatalf("grader callback %s, want success with sample %q alone", grade.Raw, einoagent.AgentName)
	}
	if sample.Reward == nil || *sample.Reward != 1 {
		t.Errorf("reward %v, want 1 (the agent answers 42)", sample.Reward)
	}
	if sample.Label == nil || *sample.Label != "42" {
		t.Errorf("sample label %v, want %q", sample.Label, "42")
	}
	msgs := make([]osmo.Message, len(sample.Messages))
	copy(msgs, sample.Messages)
	checkConversation(t, msgs)
	if len(sample.LLMCalls) < 2 {
		t.Errorf("%d llm_calls, want the tool turn and the answer", len(sample.LLMCalls))
	}

	chats := s.ctl.Chats()
	if len(chats) != len(sample.LLMCalls) {
		t.Errorf("controller saw %d LLM calls, the sample records %d", len(chats), len(sample.LLMCalls))
	}
	for i, c := range chats {
		if c.Header.Get("X-Rollout-Id") != id || c.Header.Get("X-Sample-Id") != einoagent.AgentName {
			t.Errorf("LLM call %d carried x-rollout-id %q x-sample-id %q, want %q %q", i, c.Header.Get("X-Rollout-Id"), c.Header.Get("X-Sample-Id"), id, einoagent.AgentName)
		}
		if c.Header.Get("Authorization") != "Bearer "+ctlKey {
			t.Errorf("LLM call %d Authorization %q, want the controller_api_key", i, c.Header.Get("Authorization"))
		}
		if c.Body["model"] != osmo.PlaceholderModel {
			t.Errorf("LLM call %d model %v, want %q", i, c.Body["model"], osmo.PlaceholderModel)
		}
	}

	// Exactly one of each callback, after a short wait for strays.
	time.Sleep(100 * time.Millisecond)
	if n, m := len(s.ctl.Completions(id)), len(s.ctl.GraderCallbacks(id)); n != 1 || m != 1 {
		t.Errorf("%d completion and %d grader callbacks, want exactly 1 each", n, m)
	}
	if r := s.ctl.Rejected(); len(r) != 0 {
		t.Errorf("controller refused callbacks: %s", strings.Join(r, "; "))
	}
	// The callbacks are posted before the final state is recorded.
	for {
		st, err := s.client.GetRolloutStatus(wctx, &rolloutv1.GetRolloutStatusRequest{RolloutId: id})
		if err == nil && st.GetStatus() == "success" && st.GetReward() == 1 {
			break
		}
		if err != nil || wctx.Err() != nil || (st.GetStatus() != "running" && st.GetStatus() != "grading") {
			t.Fatalf("GetRolloutStatus = %v (%v), want success with reward 1", st, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
