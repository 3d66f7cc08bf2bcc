package rollout_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
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
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/services/rollout"
)

// g2CtlKey is the controller_api_key of the G2 harness.
const g2CtlKey = "ctl-key"

// g2Harness runs a G2 rollout service over real gRPC behind a G2
// controller, which forwards the LLM calls to a policy (mockllm unless the
// test brings its own), all on loopback: policy <- controller <- service.
type g2Harness struct {
	svc    *rollout.Service
	client rolloutv1.RolloutServiceClient
	ctl    *controller.G2
	cancel context.CancelFunc
	done   chan struct{}
}

type g2Opts struct {
	// wf is the workflow the service runs. Required.
	wf  *osmo.Workflow
	cfg func(*rollout.Config)
	ctl controller.G2Options
	// mock configures mockllm; policy, when set, replaces it.
	mock   mockllm.Options
	policy http.Handler
}

func newG2Harness(t *testing.T, o g2Opts) *g2Harness {
	t.Helper()
	h := &g2Harness{done: make(chan struct{})}
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
	ps := httptest.NewServer(policy)
	t.Cleanup(ps.Close)

	o.ctl.PolicyURL = ps.URL + "/v1"
	if o.ctl.APIKey == "" {
		o.ctl.APIKey = g2CtlKey
	}
	o.ctl.Logger = quietLogger()
	var err error
	h.ctl, err = controller.NewG2("127.0.0.1:0", o.ctl)
	if err != nil {
		t.Fatal(err)
	}
	cfg := rollout.Config{
		Workflow: o.wf,
		Logger:   quietLogger(),
		Client: rollout.ClientSettings{
			Timeout:                5 * time.Second,
			MaxRetries:             1,
			CompleteRolloutRetries: 2,
			RetryBaseDelay:         10 * time.Millisecond,
			RetryMaxDelay:          50 * time.Millisecond,
		},
		Callbacks: rollout.CallbackSettings{
			Attempts:  5,
			BaseDelay: 10 * time.Millisecond,
			MaxDelay:  40 * time.Millisecond,
			Timeout:   2 * time.Second,
		},
		RolloutTimeout: 5 * time.Second,
		GradeTimeout:   5 * time.Second,
		DrainTimeout:   200 * time.Millisecond,
	}
	if o.cfg != nil {
		o.cfg(&cfg)
	}
	h.svc, err = rollout.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := server.NewGRPC("127.0.0.1:0",
		grpc.ChainUnaryInterceptor(h.svc.UnaryInterceptor), grpc.ChainStreamInterceptor(h.svc.StreamInterceptor))
	if err != nil {
		t.Fatal(err)
	}
	rolloutv1.RegisterRolloutServiceServer(srv, h.svc)

	// The controller outlives the service so callbacks posted while the
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
	conn, err := grpc.NewClient(srv.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	h.client = rolloutv1.NewRolloutServiceClient(conn)
	t.Cleanup(func() {
		_ = conn.Close()
		h.stop(t)
	})
	return h
}

// stop shuts the service down and waits (bounded) for it.
func (h *g2Harness) stop(t *testing.T) {
	h.cancel()
	select {
	case <-h.done:
	case <-time.After(10 * time.Second):
		t.Error("G2 harness did not shut down in 10s")
	}
}

// startReq is a valid G2 start for "What is 6 times 7?" addressed to the
// harness's controller, with a grader callback, the controller's key and
// label "forty-two" (which appears in nothing the workflow could see, so
// its absence there is checkable).
func (h *g2Harness) startReq(t *testing.T, id string) *rolloutv1.StartRolloutRequest {
	t.Helper()
	return &rolloutv1.StartRolloutRequest{
		RolloutId:             id,
		InitialMessages:       []*structpb.Struct{mustStruct(t, map[string]any{"role": "user", "content": "What is 6 times 7?"})},
		ChatCompletionsUrl:    h.ctl.ChatCompletionsURL(),
		CompletionCallbackUrl: h.ctl.CompletionURL(),
		GraderCallbackUrl:     proto.String(h.ctl.GraderURL()),
		Label:                 structpb.NewStringValue("forty-two"),
		Metadata:              mustStruct(t, map[string]any{"difficulty": "easy"}),
		ControllerApiKey:      proto.String(g2CtlKey),
	}
}

func (h *g2Harness) start(t *testing.T, req *rolloutv1.StartRolloutRequest) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := h.client.StartRollout(ctx, req); err != nil {
		t.Fatalf("StartRollout(%s): %v", req.GetRolloutId(), err)
	}
}

func (h *g2Harness) waitCompletion(t *testing.T, id string) controller.G2Callback {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	c, err := h.ctl.WaitCompletion(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (h *g2Harness) waitGrader(t *testing.T, id string) controller.G2Callback {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	c, err := h.ctl.WaitGrader(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitDone polls GetRollout until the rollout finished (its callbacks are
// then delivered or given up on) and returns it.
func (h *g2Harness) waitDone(t *testing.T, id string) *rolloutv1.Rollout {
	t.Helper()
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		r, err := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: id})
		if err == nil && r.GetFinishedAt() != nil {
			return r
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("rollout %s did not finish in 8s", id)
	return nil
}

func (h *g2Harness) status(t *testing.T, id string) *rolloutv1.RolloutStatus {
	t.Helper()
	st, err := h.client.GetRolloutStatus(context.Background(), &rolloutv1.GetRolloutStatusRequest{RolloutId: id})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func (h *g2Harness) health(t *testing.T) *rolloutv1.HealthResponse {
	t.Helper()
	hr, err := h.client.Health(context.Background(), &rolloutv1.HealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return hr
}

// waitHealth polls Health until ok accepts it.
func (h *g2Harness) waitHealth(t *testing.T, what string, ok func(*rolloutv1.Concurrency) bool) {
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

// mustWorkflow binds fn as a workflow named name.
func mustWorkflow(t *testing.T, name string, fn func(context.Context, *osmo.WorkflowContext[testWFConfig]) error) *osmo.Workflow {
	t.Helper()
	wf, err := osmo.NewWorkflow(osmo.WorkflowFunc[testWFConfig](fn), &testWFConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: name}})
	if err != nil {
		t.Fatal(err)
	}
	return wf
}

type testWFConfig struct {
	osmo.AgentWorkflowConfig
}

// multiplyTool is the function tool the test agent offers.
var multiplyTool = map[string]any{
	"type": "function",
	"function": map[string]any{
		"name":        "multiply",
		"description": "Multiply two integers.",
		"parameters": map[string]any{
			"type":       "object",
			"properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
			"required":   []any{"a", "b"},
		},
	},
}

// chatOnce makes one chat completion through ep and returns the answer's
// message.
func chatOnce(ctx context.Context, ep osmo.Endpoint, msgs []osmo.Message, tools []any) (osmo.Message, error) {
	return chatOnceWith(ctx, ep, msgs, tools, nil)
}

// chatOnceWith is chatOnce with extra request fields (logprobs,
// return_token_ids, ...).
func chatOnceWith(ctx context.Context, ep osmo.Endpoint, msgs []osmo.Message, tools []any, extra map[string]any) (osmo.Message, error) {
	fields := map[string]any{"model": osmo.PlaceholderModel, "messages": msgs, "tools": tools}
	for k, v := range extra {
		fields[k] = v
	}
	body, err := json.Marshal(fields)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.BaseURL+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+ep.APIKey)
	for k, v := range ep.Headers {
		req.Header.Set(k, v)
	}
	client := ep.HTTPClient
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("chat: read answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("chat: HTTP %d: %s", resp.StatusCode, data)
	}
	var out struct {
		Choices []struct {
			Message osmo.Message `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(data, &out); err != nil || len(out.Choices) == 0 {
		return nil, fmt.Errorf("chat: malformed answer %s", data)
	}
	return out.Choices[0].Message, nil
}

// runMultiplyAgent answers the prompt with the multiply tool, one LLM call
// per turn, and returns the conversation.
func runMultiplyAgent(ctx context.Context, ep osmo.Endpoint, prompt []osmo.Message) ([]osmo.Message, error) {
	msgs := append([]osmo.Message(nil), prompt...)
	for range 4 {
		m, err := chatOnce(ctx, ep, msgs, []any{multiplyTool})
		if err != nil {
			return msgs, err
		}
		msgs = append(msgs, m)
		calls, _ := m["tool_calls"].([]any)
		if len(calls) == 0 {
			return msgs, nil
		}
		for _, c := range calls {
			call, _ := c.(map[string]any)
			fn, _ := call["function"].(map[string]any)
			var args struct{ A, B int64 }
			if s, _ := fn["arguments"].(string); json.Unmarshal([]byte(s), &args) != nil || fn["name"] != "multiply" {
				return msgs, fmt.Errorf("unexpected tool call %v", call)
			}
			msgs = append(msgs, osmo.Message{"role": "tool", "tool_call_id": call["id"], "content": fmt.Sprint(args.A * args.B)})
		}
	}
	return msgs, fmt.Errorf("no final answer in 4 turns")
}

// seenInput is what a test workflow was given, for checks.
type seenInput struct {
	mu       sync.Mutex
	runs     int
	wc       []string // fmt of every WorkflowContext
	metadata []map[string]any
}

func (s *seenInput) record(wc *osmo.WorkflowContext[testWFConfig]) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runs++
	s.wc = append(s.wc, fmt.Sprintf("%+v %+v %+v %+v", wc.RolloutID, wc.Prompt, wc.Metadata, *wc.Config))
	s.metadata = append(s.metadata, wc.Metadata)
}

func (s *seenInput) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs
}

// multiplyWorkflow runs the multiply agent as sample sampleID and registers
// its conversation; with recorded it registers nil instead, leaving the
// messages to what the proxy recorded.
func multiplyWorkflow(t *testing.T, sampleID string, recorded bool, seen *seenInput) *osmo.Workflow {
	return mustWorkflow(t, "multiply-test", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		if seen != nil {
			seen.record(wc)
		}
		msgs, err := runMultiplyAgent(ctx, wc.Rollout.Endpoint(sampleID), wc.Prompt)
		if err != nil {
			return err
		}
		return wc.Rollout.Register(sampleID, osmo.SampleSourceFunc(func() ([]osmo.Message, error) {
			if recorded {
				return nil, nil
			}
			return msgs, nil
		}))
	})
}

// blockingWorkflow registers a sample and waits for its context to end;
// it records which rollouts ran and how their contexts ended.
type blockingWorkflow struct {
	mu      sync.Mutex
	runs    []string
	started map[string]bool
	causes  map[string]error
}

func newBlockingWorkflow() *blockingWorkflow {
	return &blockingWorkflow{started: map[string]bool{}, causes: map[string]error{}}
}

func (b *blockingWorkflow) workflow(t *testing.T) *osmo.Workflow {
	return mustWorkflow(t, "blocking", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		b.mu.Lock()
		b.runs = append(b.runs, wc.RolloutID)
		b.mu.Unlock()
		if err := wc.Rollout.Register("blocker", osmo.SampleSourceFunc(func() ([]osmo.Message, error) {
			return []osmo.Message{{"role": "assistant", "content": "waited"}}, nil
		})); err != nil {
			return err
		}
		b.mu.Lock()
		b.started[wc.RolloutID] = true
		b.mu.Unlock()
		<-ctx.Done()
		b.mu.Lock()
		b.causes[wc.RolloutID] = context.Cause(ctx)
		b.mu.Unlock()
		return ctx.Err()
	})
}

// waitStarted waits until the workflow of id runs.
func (b *blockingWorkflow) waitStarted(t *testing.T, id string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		b.mu.Lock()
		ok := b.started[id]
		b.mu.Unlock()
		if ok {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("workflow of %s did not start in 5s", id)
}

func (b *blockingWorkflow) ran() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.runs...)
}

// cause is how the context of id's run ended; nil while it runs.
func (b *blockingWorkflow) cause(id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.causes[id]
}
