package osmo

import (
	"context"
	"iter"
	"log/slog"
	"time"
)

// Runtime is what a rollout's host provides: the rollout service's, or a
// test's (package osmotest). Every LLM call, tool call and event of the
// rollout's samples goes through it, including an agent loop's (its
// RolloutContext.Chat posts to Endpoint of the loop's sample).
type Runtime interface {
	// Endpoint routes the LLM calls of sampleID to the rollout's policy.
	Endpoint(sampleID string) Endpoint
	// Logger is the rollout's logger (it carries rollout_id).
	Logger() *slog.Logger
	// LogEvent writes a debug event to the rollout's JSONL log (--log);
	// a no-op when that is off.
	LogEvent(name string, data map[string]any)
	// RecordToolCall counts one tool execution of sampleID and its
	// latency, in the sample's and the rollout's metrics.
	RecordToolCall(sampleID string, latency time.Duration)
}

// Hosting is for what runs workflows: osmo's rollout service and package
// osmotest. Workflow and grader authors never call it. Its methods are what those hosts need of a Workflow, a
// Rollout and a RolloutContext beyond the authors' API, kept off those types
// so that their documentation shows only what authors use.
func Hosting() hosting { return hosting{} }

// hosting carries no state: every call works on its arguments alone.
type hosting struct{}

// NewRollout binds a rollout id to its host's runtime. A nil runtime gives a
// rollout with no policy behind it (an empty Endpoint), the default logger
// and no metrics or event log.
func (hosting) NewRollout(id string, rt Runtime) *Rollout {
	return &Rollout{ID: id, rt: rt}
}

// Sources yields the sample sources registered on r so far, by id, in
// registration order. It reads a copy, so a source registered meanwhile does
// not disturb it.
func (hosting) Sources(r *Rollout) iter.Seq2[string, SampleSource] {
	return r.registered()
}

// Run executes w for one rollout with r installed in ctx (where
// RolloutFromContext finds it). req and tools are the remote-rollout (G1)
// request and the tools offered for it, nil for rollouts started otherwise.
// A panic becomes a *PanicError; returning without registering any sample
// source is ErrNoSamples.
func (hosting) Run(ctx context.Context, w *Workflow, r *Rollout, rolloutID string, prompt []Message, metadata map[string]any, label *string, req *RolloutRequest, tools []Tool) error {
	return w.execute(ctx, r, &workflowInput{
		RolloutID: rolloutID, Prompt: prompt, Metadata: metadata, Label: label, Request: req, Tools: tools,
	})
}

// ToolsFor is what w offers a remote-rollout (G1) trainer for req: an agent
// loop's GetTools (a panic becomes an error), or the tools w declares.
func (hosting) ToolsFor(w *Workflow, req *RolloutRequest) ([]Tool, error) {
	return w.toolsFor(req)
}

// LoopSampleID is the id of the one sample an AgentLoopWorkflow registers,
// known before it runs; "" for other workflows.
func (hosting) LoopSampleID(w *Workflow) string { return w.loopSample }

// ContextWithRollout returns ctx carrying r, as Run installs it.
func (hosting) ContextWithRollout(ctx context.Context, r *Rollout) context.Context {
	return contextWithRollout(ctx, r)
}

// NewRolloutContext is the context an agent loop runs with as sample
// sampleID of r.
func (hosting) NewRolloutContext(r *Rollout, sampleID string, req *RolloutRequest, tools []Tool) *RolloutContext {
	return newRolloutContext(r, sampleID, req, tools)
}
