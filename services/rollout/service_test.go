package rollout_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/services/rollout"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// rewardByCalculator grades like the built-in calculator grader.
func rewardByCalculator(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "calculator"}
	for _, s := range rollout.SamplesOf(req) {
		msgs := make([]osmo.Message, 0, len(s.GetMessages()))
		for _, m := range s.GetMessages() {
			msgs = append(msgs, m.AsMap())
		}
		r, err := graders.Calculator(osmo.LastAssistantText(msgs), req.GetLabel(), nil)
		if err != nil {
			return nil, err
		}
		resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: s.GetId(), Reward: &r})
	}
	return resp, nil
}

func TestCalculatorRolloutEndToEnd(t *testing.T) {
	g := &fakeGrader{fn: rewardByCalculator}
	h := newHarness(t, harnessOpts{
		cfg: func(c *rollout.Config) { c.Grader = g; c.GraderName = "calculator" },
		g1:  controller.Options{APIKey: "ctl-key"},
	})
	ctx := context.Background()
	req := h.initReq(t, "calc-1", 6, 7, "42")
	req.CompletionParams = mustStruct(t, map[string]any{"temperature": 0.5, "return_token_ids": true, "logprobs": true})
	req.ApiKey = proto.String("ctl-key")
	resp, err := h.client.InitRollout(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetRolloutId() != "calc-1" || len(resp.GetTools()) != 2 {
		t.Fatalf("init response = %v", resp)
	}
	comp := h.waitG1(t, "calc-1")
	if comp.Status != "COMPLETED" || comp.Reward == nil || *comp.Reward != 1.0 {
		t.Fatalf("completion = %s", comp.Raw)
	}
	if comp.Metrics["num_llm_calls"].(float64) != 2 || comp.Metrics["num_tool_calls"].(float64) != 1 {
		t.Fatalf("metrics = %v", comp.Metrics)
	}
	if comp.Metrics["prompt_tokens"].(float64) <= 0 || comp.Metrics["response_tokens"].(float64) <= 0 {
		t.Fatalf("token metrics = %v", comp.Metrics)
	}

	// Every LLM call reached the controller with the G1 body and headers.
	calls := h.g1.Chats()
	if len(calls) != 2 {
		t.Fatalf("controller saw %d LLM calls, want 2", len(calls))
	}
	for i, c := range calls {
		if c.Body["rollout_id"] != "calc-1" {
			t.Errorf("call %d: rollout_id = %v", i, c.Body["rollout_id"])
		}
		if c.Header.Get("Authorization") != "Bearer ctl-key" {
			t.Errorf("call %d: Authorization = %q", i, c.Header.Get("Authorization"))
		}
		if c.Header.Get("X-Rollout-Id") != "calc-1" || c.Header.Get("X-Sample-Id") != calculator.Name {
			t.Errorf("call %d: ids = %q/%q", i, c.Header.Get("X-Rollout-Id"), c.Header.Get("X-Sample-Id"))
		}
		if c.Body["temperature"] != 0.5 {
			t.Errorf("call %d: completion_params not applied: %v", i, c.Body)
		}
	}
	// The append-only history: the second call carries the first answer and the tool result.
	if n := len(calls[1].Body["messages"].([]any)); n != 3 {
		t.Errorf("second call has %d messages, want 3", n)
	}

	// The sample holds the recorded calls with exact tokens.
	r := h.waitDone(t, "calc-1")
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || r.GetReward() != 1 {
		t.Fatalf("rollout = %v", r)
	}
	s := r.GetSamples()[0]
	if s.GetId() != calculator.Name || s.GetLabel() != "42" || len(s.GetLlmCalls()) != 2 {
		t.Fatalf("sample = %v", s)
	}
	for i, c := range s.GetLlmCalls() {
		if len(c.GetCompletionTokenIds()) == 0 || len(c.GetPromptTokenIds()) == 0 || len(c.GetLogprobs()) == 0 {
			t.Errorf("call %d lacks token ids or logprobs: %v", i, c)
		}
		if c.GetResponseMessage() == nil || c.GetUsage().GetTotalTokens() == 0 {
			t.Errorf("call %d lacks response or usage", i)
		}
	}
	if g.count() != 1 {
		t.Fatalf("grader ran %d times, want 1", g.count())
	}
}

func TestInitIsIdempotent(t *testing.T) {
	var runs atomic.Int32
	loop := &countingLoop{runs: &runs}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.AgentLoop = loop }})
	ctx := context.Background()
	req := h.initReq(t, "idem-1", 2, 3, nil)
	var wg sync.WaitGroup
	resps := make([]*rolloutv1.InitRolloutResponse, 8)
	for i := range resps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := h.client.InitRollout(ctx, req)
			if err != nil {
				t.Error(err)
				return
			}
			resps[i] = r
		}()
	}
	wg.Wait()
	for _, r := range resps[1:] {
		if !proto.Equal(r, resps[0]) {
			t.Fatalf("duplicate init answered differently: %v vs %v", r, resps[0])
		}
	}
	h.waitG1(t, "idem-1")
	// After completion a duplicate still answers the same and starts nothing.
	r, err := h.client.InitRollout(ctx, req)
	if err != nil || !proto.Equal(r, resps[0]) {
		t.Fatalf("late duplicate: %v %v", r, err)
	}
	time.Sleep(50 * time.Millisecond)
	if runs.Load() != 1 {
		t.Fatalf("agent ran %d times, want 1", runs.Load())
	}
	if n := len(h.g1.Completions("idem-1")); n != 1 {
		t.Fatalf("%d completions, want 1", n)
	}

	// The idempotency key wins over the rollout id; another key for the same id conflicts.
	keyed := h.initReq(t, "idem-2", 2, 3, nil)
	keyed.IdempotencyKey = proto.String("k-1")
	if _, err := h.client.InitRollout(ctx, keyed); err != nil {
		t.Fatal(err)
	}
	other := proto.Clone(keyed).(*rolloutv1.InitRolloutRequest)
	other.IdempotencyKey = proto.String("k-2")
	if _, err := h.client.InitRollout(ctx, other); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("same rollout id under another key: %v, want AlreadyExists", err)
	}
}

// countingLoop completes at once and counts runs.
type countingLoop struct{ runs *atomic.Int32 }

func (*countingLoop) Name() string                                       { return "counting" }
func (*countingLoop) GetTools(*osmo.RolloutRequest) ([]osmo.Tool, error) { return nil, nil }
func (l *countingLoop) Run(_ context.Context, rc *osmo.RolloutContext) (*osmo.RolloutResult, error) {
	l.runs.Add(1)
	return rc.Complete(rc.Request.Messages, "stop", osmo.Float(0.5)), nil
}

// flakyToolsLoop fails GetTools the first time.
type flakyToolsLoop struct {
	countingLoop
	calls atomic.Int32
}

func (l *flakyToolsLoop) GetTools(*osmo.RolloutRequest) ([]osmo.Tool, error) {
	if l.calls.Add(1) == 1 {
		return nil, errors.New("tool registry unavailable")
	}
	return []osmo.Tool{{"type": "function", "function": map[string]any{"name": "noop"}}}, nil
}

func TestFailedInitClearsRecord(t *testing.T) {
	var runs atomic.Int32
	loop := &flakyToolsLoop{countingLoop: countingLoop{runs: &runs}}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.AgentLoop = loop }})
	req := h.initReq(t, "flaky-1", 1, 1, nil)
	_, err := h.client.InitRollout(context.Background(), req)
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "tool registry unavailable") {
		t.Fatalf("first init: %v, want Internal naming the cause", err)
	}
	if _, err := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: "flaky-1"}); status.Code(err) != codes.NotFound {
		t.Fatalf("failed init left a record: %v", err)
	}
	resp, err := h.client.InitRollout(context.Background(), req)
	if err != nil || len(resp.GetTools()) != 1 {
		t.Fatalf("retry: %v %v", resp, err)
	}
	if c := h.waitG1(t, "flaky-1"); c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != 0.5 {
		t.Fatalf("completion %s", c.Raw)
	}
}

// gateLoop blocks every run until released and tracks concurrency.
type gateLoop struct {
	release chan struct{}
	running atomic.Int32
	peak    atomic.Int32
}

func (*gateLoop) Name() string                                       { return "gate" }
func (*gateLoop) GetTools(*osmo.RolloutRequest) ([]osmo.Tool, error) { return nil, nil }
func (l *gateLoop) Run(ctx context.Context, rc *osmo.RolloutContext) (*osmo.RolloutResult, error) {
	n := l.running.Add(1)
	defer l.running.Add(-1)
	for {
		p := l.peak.Load()
		if n <= p || l.peak.CompareAndSwap(p, n) {
			break
		}
	}
	select {
	case <-l.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return rc.Complete(nil, "stop", nil), nil
}

func TestConcurrencyLimitQueues(t *testing.T) {
	loop := &gateLoop{release: make(chan struct{})}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.AgentLoop = loop; c.MaxConcurrent = 2 }})
	for i := range 5 {
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "q-"+string(rune('a'+i)), 1, 1, nil)); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for loop.running.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	hr, err := h.client.Health(context.Background(), &rolloutv1.HealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if hr.GetActiveRollouts() != 5 || hr.GetAgentLoop() != "gate" || hr.GetStatus() != "healthy" {
		t.Fatalf("health = %v", hr)
	}
	queued := 0
	for i := range 5 {
		r, _ := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: "q-" + string(rune('a'+i))})
		if r.GetState() == rolloutv1.State_STATE_QUEUED {
			queued++
		}
	}
	if queued != 3 {
		t.Fatalf("%d queued, want 3", queued)
	}
	close(loop.release)
	for i := range 5 {
		h.waitG1(t, "q-"+string(rune('a'+i)))
	}
	if p := loop.peak.Load(); p != 2 {
		t.Fatalf("peak concurrency %d, want 2", p)
	}
}

func TestCompletionCallbackRetries(t *testing.T) {
	t.Run("5xx retried until 200", func(t *testing.T) {
		h := newHarness(t, harnessOpts{g1: controller.Options{FailCompletions: 2, FailStatus: 503}})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "cb-1", 3, 4, nil)); err != nil {
			t.Fatal(err)
		}
		c := h.waitG1(t, "cb-1")
		if c.Status != "COMPLETED" || h.g1.FailedCallbacks() != 2 || len(h.g1.Completions("cb-1")) != 1 {
			t.Fatalf("status %s failed=%d completions=%d", c.Status, h.g1.FailedCallbacks(), len(h.g1.Completions("cb-1")))
		}
		if r := h.waitDone(t, "cb-1"); r.GetCallbackError() != "" {
			t.Fatalf("callback error %q", r.GetCallbackError())
		}
	})
	t.Run("5xx past the delivery deadline gives up", func(t *testing.T) {
		h := newHarness(t, harnessOpts{
			g1:  controller.Options{FailCompletions: 1000, FailStatus: 500},
			cfg: func(c *rollout.Config) { c.Callbacks.Deadline = 400 * time.Millisecond },
		})
		began := time.Now()
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "cb-2", 3, 4, nil)); err != nil {
			t.Fatal(err)
		}
		r := h.waitDone(t, "cb-2")
		if h.g1.FailedCallbacks() < 3 || !strings.Contains(r.GetCallbackError(), "over the delivery deadline (400ms)") {
			t.Fatalf("failed=%d callback_error=%q", h.g1.FailedCallbacks(), r.GetCallbackError())
		}
		if took := time.Since(began); took < 300*time.Millisecond || took > 5*time.Second {
			t.Errorf("gave up after %v for a 400ms deadline", took)
		}
	})
	t.Run("4xx is not retried", func(t *testing.T) {
		h := newHarness(t, harnessOpts{g1: controller.Options{FailCompletions: 10, FailStatus: 409}})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "cb-3", 3, 4, nil)); err != nil {
			t.Fatal(err)
		}
		r := h.waitDone(t, "cb-3")
		if h.g1.FailedCallbacks() != 1 || !strings.Contains(r.GetCallbackError(), "HTTP 409") {
			t.Fatalf("failed=%d callback_error=%q", h.g1.FailedCallbacks(), r.GetCallbackError())
		}
	})
	t.Run("a refusing callback URL fails without hurting other rollouts", func(t *testing.T) {
		h := newHarness(t, harnessOpts{})
		bad := h.initReq(t, "cb-refused", 3, 4, nil)
		bad.ServerUrl = "http://127.0.0.1:1" // nothing listens on port 1
		if _, err := h.client.InitRollout(context.Background(), bad); err != nil {
			t.Fatal(err)
		}
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "cb-ok", 3, 4, nil)); err != nil {
			t.Fatal(err)
		}
		if c := h.waitG1(t, "cb-ok"); c.Status != "COMPLETED" {
			t.Fatalf("healthy rollout: %s", c.Raw)
		}
		r := h.waitDone(t, "cb-refused")
		if r.GetState() != rolloutv1.State_STATE_FAILED || r.GetCallbackError() == "" {
			t.Fatalf("refused rollout = %v", r)
		}
	})
}

// errLoop fails in the ways an agent can.
type errLoop struct{ mode string }

func (l errLoop) Name() string                                     { return "err-" + l.mode }
func (errLoop) GetTools(*osmo.RolloutRequest) ([]osmo.Tool, error) { return nil, nil }
func (l errLoop) Run(ctx context.Context, rc *osmo.RolloutContext) (*osmo.RolloutResult, error) {
	switch l.mode {
	case "error":
		return rc.Error("the tool server is down"), nil
	case "return":
		return nil, errors.New("database exploded")
	case "panic":
		panic("nil map write")
	case "nil":
		return nil, nil
	case "slow":
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return nil, errors.New("unknown mode")
}

func TestAgentFailuresBecomeErrorCompletions(t *testing.T) {
	for _, tc := range []struct {
		mode, want string
	}{
		{"error", "the tool server is down"},
		{"return", "database exploded"},
		{"panic", "agent loop panicked: nil map write"},
		{"nil", "neither a result nor an error"},
		{"slow", "timed out"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
				c.AgentLoop = errLoop{tc.mode}
				c.RolloutTimeout = 200 * time.Millisecond
			}})
			if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "e-1", 1, 1, "1")); err != nil {
				t.Fatal(err)
			}
			c := h.waitG1(t, "e-1")
			if c.Status != "ERROR" || c.FinishReason != "error" || !strings.Contains(c.ErrorMessage, tc.want) {
				t.Fatalf("completion = %s", c.Raw)
			}
			if c.FinalMessages == nil || len(c.FinalMessages) != 0 || !strings.Contains(string(c.Raw), `"final_messages":[]`) {
				t.Fatalf("final_messages must be []: %s", c.Raw)
			}
			if c.Reward != nil {
				t.Fatalf("an error completion has no reward: %s", c.Raw)
			}
		})
	}
}

func TestUpstreamFailuresNameTheCause(t *testing.T) {
	for _, tc := range []struct {
		fail, want string
	}{
		{"malformed", "HTTP 502"},
		{"500", "HTTP 502"},
		{"hang", "HTTP 504"},
		{"429", "HTTP 429"},
	} {
		t.Run(tc.fail, func(t *testing.T) {
			h := newHarness(t, harnessOpts{
				mock: mockOpts(tc.fail),
				cfg: func(c *rollout.Config) {
					c.Client.Timeout = 300 * time.Millisecond
				},
			})
			if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "up-1", 2, 2, "4")); err != nil {
				t.Fatal(err)
			}
			c := h.waitG1(t, "up-1")
			if c.Status != "ERROR" || !strings.Contains(c.ErrorMessage, tc.want) {
				t.Fatalf("completion = %s", c.Raw)
			}
		})
	}
}

func TestGrading(t *testing.T) {
	t.Run("no ground truth: no grading, reward omitted", func(t *testing.T) {
		g := &fakeGrader{fn: rewardByCalculator}
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Grader = g }})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "g-1", 5, 5, nil)); err != nil {
			t.Fatal(err)
		}
		c := h.waitG1(t, "g-1")
		if c.Status != "COMPLETED" || c.Reward != nil || strings.Contains(string(c.Raw), `"reward"`) || g.count() != 0 {
			t.Fatalf("completion %s, grader calls %d", c.Raw, g.count())
		}
	})
	t.Run("numeric ground truth is graded as text", func(t *testing.T) {
		g := &fakeGrader{fn: rewardByCalculator}
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Grader = g }})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "g-2", 5, 5, 25)); err != nil {
			t.Fatal(err)
		}
		if c := h.waitG1(t, "g-2"); c.Reward == nil || *c.Reward != 1 {
			t.Fatalf("completion %s", c.Raw)
		}
	})
	t.Run("wrong answer scores 0", func(t *testing.T) {
		g := &fakeGrader{fn: rewardByCalculator}
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Grader = g }})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "g-3", 5, 5, "26")); err != nil {
			t.Fatal(err)
		}
		if c := h.waitG1(t, "g-3"); c.Reward == nil || *c.Reward != 0 {
			t.Fatalf("completion %s", c.Raw)
		}
	})
	t.Run("grader error is an ERROR completion that keeps the messages", func(t *testing.T) {
		g := &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
			return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Error: "grader returned NaN for sample calculator"}, nil
		}}
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Grader = g }})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "g-4", 5, 5, "25")); err != nil {
			t.Fatal(err)
		}
		c := h.waitG1(t, "g-4")
		if c.Status != "ERROR" || c.Reward != nil || !strings.Contains(c.ErrorMessage, "NaN") || len(c.FinalMessages) == 0 {
			t.Fatalf("completion %s", c.Raw)
		}
		if r := h.waitDone(t, "g-4"); r.GetErrorCategory() != "grader_error" {
			t.Fatalf("category %q", r.GetErrorCategory())
		}
	})
	t.Run("grader unreachable until the deadline", func(t *testing.T) {
		g := &fakeGrader{fn: func(*graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
			return nil, status.Error(codes.DeadlineExceeded, "context deadline exceeded")
		}}
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Grader = g }})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "g-5", 5, 5, "25")); err != nil {
			t.Fatal(err)
		}
		if c := h.waitG1(t, "g-5"); c.Status != "ERROR" || !strings.Contains(c.ErrorMessage, "grading failed") {
			t.Fatalf("completion %s", c.Raw)
		}
	})
}

func TestValidation(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	big := strings.Repeat("x", 2<<20)
	for _, tc := range []struct {
		name  string
		edit  func(*rolloutv1.InitRolloutRequest)
		field string
	}{
		{"blank id", func(r *rolloutv1.InitRolloutRequest) { r.RolloutId = "  " }, "rollout_id"},
		{"long id", func(r *rolloutv1.InitRolloutRequest) { r.RolloutId = strings.Repeat("a", 257) }, "rollout_id"},
		{"no server_url", func(r *rolloutv1.InitRolloutRequest) { r.ServerUrl = "" }, "server_url"},
		{"ftp server_url", func(r *rolloutv1.InitRolloutRequest) { r.ServerUrl = "ftp://x" }, "server_url"},
		{"no messages", func(r *rolloutv1.InitRolloutRequest) { r.Messages = nil }, "messages"},
		{"no completion_params", func(r *rolloutv1.InitRolloutRequest) { r.CompletionParams = nil }, "completion_params"},
		{"zero max_turns", func(r *rolloutv1.InitRolloutRequest) { r.MaxTurns = proto.Int32(0) }, "max_turns"},
		{"negative max_tokens_total", func(r *rolloutv1.InitRolloutRequest) { r.MaxTokensTotal = proto.Int32(-1) }, "max_tokens_total"},
		{"api_key with a line break", func(r *rolloutv1.InitRolloutRequest) { r.ApiKey = proto.String("k\nX-Injected: 1") }, "api_key"},
		{"metadata too large", func(r *rolloutv1.InitRolloutRequest) {
			r.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{"blob": structpb.NewStringValue(big)}}
		}, "metadata"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := h.initReq(t, "v-1", 1, 1, nil)
			tc.edit(req)
			_, err := h.client.InitRollout(context.Background(), req)
			st := status.Convert(err)
			if st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), tc.field+":") {
				t.Fatalf("got %v, want InvalidArgument naming %s", err, tc.field)
			}
		})
	}
	// The service still serves after all that.
	if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "v-ok", 1, 1, nil)); err != nil {
		t.Fatal(err)
	}
	h.waitG1(t, "v-ok")
}

func TestAPIKey(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.APIKey = "s3cret" }})
	ctx := context.Background()
	req := h.initReq(t, "auth-1", 1, 2, nil)
	for _, tc := range []struct {
		header string
		ok     bool
	}{
		{"", false},
		{"Bearer wrong", false},
		{"Bearer s3cret", true},
		{"s3cret", true},
		{"bearer s3cret", true},
	} {
		c := ctx
		if tc.header != "" {
			c = metadata.AppendToOutgoingContext(ctx, "authorization", tc.header)
		}
		_, err := h.client.PlatformHealth(c, &rolloutv1.HealthRequest{})
		if tc.ok != (err == nil) {
			t.Errorf("authorization %q: err = %v", tc.header, err)
		}
		if !tc.ok && (status.Code(err) != codes.Unauthenticated || status.Convert(err).Message() != "Invalid or missing API key") {
			t.Errorf("authorization %q: %v", tc.header, err)
		}
	}
	if _, err := h.client.InitRollout(ctx, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("init without key: %v", err)
	}
	if _, err := h.client.Health(ctx, &rolloutv1.HealthRequest{}); err != nil {
		t.Fatalf("health needs no key: %v", err)
	}

	noKey := newHarness(t, harnessOpts{})
	if _, err := noKey.client.PlatformHealth(ctx, &rolloutv1.HealthRequest{}); status.Code(err) != codes.NotFound {
		t.Fatalf("platform health without a configured key: %v, want NotFound", err)
	}
}

func TestWatchReplaysAndStreams(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for _, id := range []string{"w-1", "w-2"} {
		if _, err := h.client.InitRollout(ctx, h.initReq(t, id, 2, 2, nil)); err != nil {
			t.Fatal(err)
		}
		h.waitDone(t, id)
	}
	stream, err := h.client.WatchRollouts(ctx, &rolloutv1.WatchRolloutsRequest{AfterSequence: 0})
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	var last int64
	for len(seen) < 2 {
		r, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if r.GetSequence() <= last {
			t.Fatalf("sequence went from %d to %d", last, r.GetSequence())
		}
		last = r.GetSequence()
		seen = append(seen, r.GetRolloutId())
	}
	if _, err := h.client.InitRollout(ctx, h.initReq(t, "w-3", 2, 2, nil)); err != nil {
		t.Fatal(err)
	}
	r, err := stream.Recv()
	if err != nil || r.GetRolloutId() != "w-3" || len(r.GetSamples()) != 1 {
		t.Fatalf("live rollout: %v %v", r, err)
	}
	// Resuming after the last seen sequence replays nothing old.
	resumed, err := h.client.WatchRollouts(ctx, &rolloutv1.WatchRolloutsRequest{AfterSequence: r.GetSequence()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.InitRollout(ctx, h.initReq(t, "w-4", 2, 2, nil)); err != nil {
		t.Fatal(err)
	}
	if r, err := resumed.Recv(); err != nil || r.GetRolloutId() != "w-4" {
		t.Fatalf("resumed watch got %v %v, want w-4", r, err)
	}
}

func TestRecordTTLPrunes(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.RecordTTL = 100 * time.Millisecond
	}})
	if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "ttl-1", 1, 1, nil)); err != nil {
		t.Fatal(err)
	}
	h.waitG1(t, "ttl-1")
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		_, err := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: "ttl-1"})
		if status.Code(err) == codes.NotFound {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("finished rollout was not pruned after its TTL")
}

// TestRecordBytesBound: finished records are bounded by bytes as well as
// by TTL, the oldest dropped first; what is kept still answers GetRollout
// in full, and a dropped one is still answered from its lifecycle (state,
// reward; the idempotency and status it gives are kept for the TTL).
func TestRecordBytesBound(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.Grader = &fakeGrader{fn: rewardByCalculator}
		c.MaxRecordBytes = 4000 // about two records
		c.Metrics = reg
	}})
	ctx := context.Background()
	ids := []string{"b-1", "b-2", "b-3", "b-4", "b-5"}
	for i, id := range ids {
		if _, err := h.client.InitRollout(ctx, h.initReq(t, id, i+2, 3, fmt.Sprint((i+2)*3))); err != nil {
			t.Fatal(err)
		}
		h.waitG1(t, id)
		h.waitDone(t, id)
	}
	for _, id := range ids[:2] {
		r, err := h.client.GetRollout(ctx, &rolloutv1.GetRolloutRequest{RolloutId: id})
		if err != nil || len(r.GetSamples()) != 0 || r.GetReward() != 1 || r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
			t.Errorf("%s: %v %v, want its lifecycle without samples", id, r, err)
		}
		if st := h.status(t, id); st.GetStatus() != "success" {
			t.Errorf("%s: status %v", id, st)
		}
	}
	r, err := h.client.GetRollout(ctx, &rolloutv1.GetRolloutRequest{RolloutId: "b-5"})
	if err != nil {
		t.Fatal(err)
	}
	s := r.GetSamples()
	if r.GetReward() != 1 || r.GetWire() != "g1" || len(s) != 1 || len(s[0].GetMessages()) < 3 || len(s[0].GetLlmCalls()) < 2 || r.GetMetrics().GetNumLlmCalls() < 2 || r.GetSequence() <= 0 {
		t.Errorf("the kept record lost parts: %v", r)
	}
	if got, err := gatherValue(reg, "osmo_rollout_records_bytes"); err != nil || got > 4000 || got == 0 {
		t.Errorf("records hold %v bytes (%v), want at most the bound", got, err)
	}
}

func TestEventLog(t *testing.T) {
	dir := t.TempDir()
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.LogDir = dir }})
	if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "log-1.a_B", 3, 3, nil)); err != nil {
		t.Fatal(err)
	}
	h.waitG1(t, "log-1.a_B")
	h.waitDone(t, "log-1.a_B")
	files, err := filepath.Glob(filepath.Join(dir, "*", "rollout-*.jsonl"))
	if err != nil || len(files) != 1 {
		t.Fatalf("log files %v %v", files, err)
	}
	if filepath.Base(files[0]) != "rollout-log-1.a_B.jsonl" {
		t.Fatalf("file name %q", filepath.Base(files[0]))
	}
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range []string{`"event":"init"`, `"event":"pre_llm"`, `"event":"llm_call"`, `"event":"tool_call"`, `"event":"tools_executed"`, `"event":"completion"`} {
		if !strings.Contains(string(data), ev) {
			t.Errorf("log lacks %s:\n%s", ev, data)
		}
	}
}

// TestEventLogFileNames: every rollout gets its own event file, whatever its
// id holds and however long it is (up to the 256 characters an id may have),
// and every record in a file names that file's rollout.
func TestEventLogFileNames(t *testing.T) {
	dir := t.TempDir()
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.LogDir = dir }})
	ids := []string{
		"col x", "col_x", // sanitize to the same name
		"a/b", "a_b", "a\\b",
		strings.Repeat("r", 256),           // too long for a plain name
		strings.Repeat("r", 255),           // too long, and shares a prefix with the one above
		strings.Repeat("é", 256),           // 512 bytes
		"col_x~" + strings.Repeat("0", 16), // looks like a hashed name
		"日本語のロールアウト",
	}
	for _, id := range ids {
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, id, 2, 3, nil)); err != nil {
			t.Fatalf("init %q: %v", id, err)
		}
	}
	for _, id := range ids {
		h.waitG1(t, id)
		h.waitDone(t, id)
	}
	files, err := filepath.Glob(filepath.Join(dir, "*", "rollout-*.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]string{}
	for _, f := range files {
		if n := len(filepath.Base(f)); n > 255 {
			t.Errorf("file name of %d bytes: %s", n, filepath.Base(f))
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var owner string
		for i, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			var rec map[string]any
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				t.Fatalf("%s line %d: %v", f, i+1, err)
			}
			id, _ := rec["rollout_id"].(string)
			if i == 0 {
				owner = id
			} else if id != owner {
				t.Errorf("%s mixes rollouts %q and %q", filepath.Base(f), owner, id)
				break
			}
			if rec["event"] == nil || rec["ts"] == nil {
				t.Errorf("%s line %d lacks event or ts: %s", filepath.Base(f), i+1, line)
			}
		}
		if prev, dup := byID[owner]; dup {
			t.Errorf("rollout %q has two files: %s and %s", owner, prev, f)
		}
		byID[owner] = filepath.Base(f)
	}
	for _, id := range ids {
		if byID[id] == "" {
			t.Errorf("no event file for rollout %q (files %v)", id, files)
		}
	}
	if got := byID["col_x"]; got != "rollout-col_x.jsonl" {
		t.Errorf("file of col_x is %q, want rollout-col_x.jsonl", got)
	}
}

func TestShutdownCancelsStuckRolloutsAndStillCompletes(t *testing.T) {
	loop := &gateLoop{release: make(chan struct{})} // never released
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.AgentLoop = loop
		c.DrainTimeout = 100 * time.Millisecond
	}})
	if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "sd-1", 1, 1, nil)); err != nil {
		t.Fatal(err)
	}
	for loop.running.Load() == 0 {
		time.Sleep(2 * time.Millisecond)
	}
	h.stop(t)
	comps := h.g1.Completions("sd-1")
	if len(comps) != 1 || comps[0].Status != "ERROR" || !strings.Contains(comps[0].ErrorMessage, "cancelled") {
		t.Fatalf("completions = %+v", comps)
	}
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	g := &fakeGrader{fn: rewardByCalculator}
	h := newHarness(t, harnessOpts{
		cfg: func(c *rollout.Config) { c.Metrics = reg; c.Grader = g },
		g1:  controller.Options{FailCompletions: 1, FailStatus: 503},
	})
	if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "m-1", 4, 5, "20")); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.InitRollout(context.Background(), &rolloutv1.InitRolloutRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("empty init: %v, want InvalidArgument", err)
	}
	h.waitG1(t, "m-1")
	h.waitDone(t, "m-1")
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"osmo_rollouts_started_total", nil, 1},
		{"osmo_rollouts_finished_total", []string{"", "COMPLETED"}, 1}, // labels sort by name: error_category, status
		{"osmo_callback_attempts_total", []string{"retry"}, 1},
		{"osmo_callback_attempts_total", []string{"ok"}, 1},
		{"osmo_rollouts_running", nil, 0},
		{"osmo_rollouts_queued", nil, 0},
		{"osmo_rollouts_rejected_total", []string{"invalid"}, 1},
		{"osmo_rollouts_rejected_total", []string{"capacity"}, 0},
	} {
		got, err := gatherValue(reg, tc.name, tc.labels...)
		if err != nil || got != tc.want {
			t.Errorf("%s%v = %v (%v), want %v", tc.name, tc.labels, got, err, tc.want)
		}
	}
	if n, _ := gatherValue(reg, "osmo_llm_tokens_total", "output"); n <= 0 {
		t.Errorf("output tokens = %v", n)
	}
	if n, err := testutil.GatherAndCount(reg, "osmo_llm_call_duration_seconds", "osmo_rollout_duration_seconds", "osmo_rollout_reward", "osmo_rollout_grade_duration_seconds"); err != nil || n != 4 {
		t.Errorf("histograms present = %d (%v), want 4", n, err)
	}
}

// gatherValue reads one counter or gauge sample from reg.
func gatherValue(reg *prometheus.Registry, name string, labelValues ...string) (float64, error) {
	mfs, err := reg.Gather()
	if err != nil {
		return 0, err
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labelValues) {
				continue
			}
			for i, l := range m.GetLabel() {
				if l.GetValue() != labelValues[i] {
					continue metric
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue(), nil
			}
			return m.GetGauge().GetValue(), nil
		}
	}
	return 0, fmt.Errorf("%s%v not found", name, labelValues)
}
