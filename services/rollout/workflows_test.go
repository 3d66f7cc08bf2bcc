package rollout_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
)

// The workflows the tests run, and the agent they share.

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
	params := map[string]any{"tools": tools}
	for k, v := range extra {
		params[k] = v
	}
	res, err := osmo.ChatCompletion(ctx, ep, msgs, params)
	if err != nil {
		return nil, err
	}
	return res.Message, nil
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
		return wc.Rollout.Register(sampleID, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			if recorded {
				return nil, nil
			}
			return osmo.EncodeMessages(msgs)
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
		if err := wc.Rollout.Register("blocker", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return osmo.EncodeMessages([]osmo.Message{{"role": "assistant", "content": "waited"}})
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
