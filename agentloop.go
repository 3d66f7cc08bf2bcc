package osmo

import (
	"context"
	"errors"
	"time"
)

// Default budgets of a remote rollout when the trainer leaves them out.
const (
	DefaultMaxTurns       = 10
	DefaultMaxTokensTotal = 8192
)

// Tool is an OpenAI function tool schema:
// {"type":"function","function":{"name":..., "description":..., "parameters":{...}}}.
type Tool = map[string]any

// RolloutRequest is what the trainer sent to /v1/rollout/init.
type RolloutRequest struct {
	RolloutID        string
	ServerURL        string
	Messages         []Message
	CompletionParams map[string]any
	ToolServerURL    string
	MaxTurns         int
	MaxTokensTotal   int
	Metadata         map[string]any
	IdempotencyKey   string
}

// RolloutAgentLoop is a remote-rollout agent: the Go face of the Osmosis
// RolloutAgentLoop. Implementations must be safe for concurrent use: one value
// serves every rollout.
type RolloutAgentLoop interface {
	// Name identifies the loop (reported by /health).
	Name() string
	// GetTools returns the tools offered for this request, in OpenAI function
	// format. It runs inside /v1/rollout/init; an error fails the init (500)
	// and lets the trainer retry.
	GetTools(req *RolloutRequest) ([]Tool, error)
	// Run executes the agent and returns rc.Complete(...) or rc.Error(...).
	// Returning a non-nil error (or panicking) is the same as rc.Error with
	// the error's text. ctx ends when the rollout is cancelled or times out.
	Run(ctx context.Context, rc *RolloutContext) (*RolloutResult, error)
}

// RolloutContext is passed to RolloutAgentLoop.Run. AgentLoopWorkflow
// builds it; a test of a loop builds one with osmotest.NewRolloutContext.
type RolloutContext struct {
	// Request is the trainer's request.
	Request *RolloutRequest
	// Tools are the tools GetTools returned.
	Tools []Tool

	// The loop's one sample in its rollout: where Chat goes, and whose
	// tool calls and events RecordToolCall and LogEvent report.
	rollout  *Rollout
	sampleID string
}

// newRolloutContext is Hosting().NewRolloutContext.
func newRolloutContext(r *Rollout, sampleID string, req *RolloutRequest, tools []Tool) *RolloutContext {
	return &RolloutContext{Request: req, Tools: tools, rollout: r, sampleID: sampleID}
}

// Chat calls the policy with the full message history. params are merged over
// the request's completion_params (pass nil to use them as they are). The
// tools GetTools returned are offered on every call unless params set "tools".
// Chat returns the whole completion, so it asks for one: "stream" and
// "stream_options" are left out whatever completion_params say. It asks for
// "logprobs" unless the params say otherwise, as the Osmosis SDK's client
// does: a trainer needs the policy's log probabilities without asking.
func (c *RolloutContext) Chat(ctx context.Context, messages []Message, params map[string]any) (*ChatResult, error) {
	if c.rollout == nil {
		return nil, errors.New("osmo: RolloutContext has no rollout")
	}
	merged := make(map[string]any, len(c.Request.CompletionParams)+len(params))
	for k, v := range c.Request.CompletionParams {
		merged[k] = v
	}
	for k, v := range params {
		merged[k] = v
	}
	delete(merged, "stream")
	delete(merged, "stream_options")
	if _, ok := merged["logprobs"]; !ok {
		merged["logprobs"] = true
	}
	if _, ok := merged["tools"]; !ok && len(c.Tools) > 0 {
		merged["tools"] = c.Tools
	}
	return ChatCompletion(ctx, c.rollout.Endpoint(c.sampleID), messages, merged)
}

// RecordToolCall records one tool execution for the rollout's metrics.
func (c *RolloutContext) RecordToolCall(latency time.Duration) {
	if c.rollout != nil {
		c.rollout.RecordToolCall(c.sampleID, latency)
	}
}

// LogEvent writes a debug event to the rollout's JSONL log when --log is set.
func (c *RolloutContext) LogEvent(name string, data map[string]any) {
	if c.rollout != nil {
		c.rollout.LogEvent(name, data)
	}
}

// Complete ends the rollout successfully. reward may be nil: a grader (or the
// trainer) decides it.
func (c *RolloutContext) Complete(messages []Message, finishReason string, reward *float64) *RolloutResult {
	if finishReason == "" {
		finishReason = "stop"
	}
	return &RolloutResult{Status: StatusCompleted, FinalMessages: messages, FinishReason: finishReason, Reward: reward}
}

// Error ends the rollout with an error the trainer will see.
func (c *RolloutContext) Error(message string) *RolloutResult {
	return &RolloutResult{Status: StatusError, FinishReason: "error", ErrorMessage: message}
}

// Status values of a remote-rollout completion.
const (
	StatusCompleted = "COMPLETED"
	StatusError     = "ERROR"
)

// RolloutResult is what an agent loop returns.
type RolloutResult struct {
	Status        string
	FinalMessages []Message
	FinishReason  string
	ErrorMessage  string
	Reward        *float64
	ExtraFields   map[string]any
}

// Float returns a pointer to v, for optional rewards.
func Float(v float64) *float64 { return &v }
