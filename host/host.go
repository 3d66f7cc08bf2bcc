// Package host runs workflows: it is the API of the rollout service, the
// evaluator and test harnesses. Workflow and grader authors do not need it;
// package osmo holds everything they call.
//
// A host builds a rollout over its Runtime (NewRollout), runs a workflow on
// it (Run) and reads the sample sources the workflow registered (Sources).
// The grader service builds a grader's context with NewGraderContext. A test
// of an agent loop builds the loop's context with NewRolloutContext.
package host

import (
	"context"
	"iter"
	"log/slog"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/hostlink"
)

// Runtime is what a rollout's host provides: the rollout service's, or a
// test's. Every LLM call, tool call and event of the rollout's samples goes
// through it, including an agent loop's (its RolloutContext.Chat posts to
// Endpoint of the loop's sample).
type Runtime interface {
	// Endpoint routes the LLM calls of sampleID to the rollout's policy.
	Endpoint(sampleID string) osmo.Endpoint
	// Logger is the rollout's logger (it carries rollout_id).
	Logger() *slog.Logger
	// LogEvent writes a debug event to the rollout's JSONL log (--log);
	// a no-op when that is off.
	LogEvent(name string, data map[string]any)
	// RecordToolCall counts one tool execution of sampleID and its
	// latency, in the sample's and the rollout's metrics.
	RecordToolCall(sampleID string, latency time.Duration)
}

// Input is one rollout's input, as a host hands it to a workflow.
type Input struct {
	RolloutID string
	Prompt    []osmo.Message
	Metadata  map[string]any
	// Label is the row's label (ground truth), nil when it has none. It
	// reaches only workflows that are osmo.LabelReaders.
	Label *string
	// Request is the remote-rollout (G1) request the input came from, and
	// Tools what the workflow offered for it (ToolsFor); both nil for
	// rollouts started otherwise. An osmo.AgentLoopWorkflow hands them to
	// its loop.
	Request *osmo.RolloutRequest
	Tools   []osmo.Tool
}

// Source is a sample source a workflow registered, and its sample id.
type Source struct {
	ID     string
	Source osmo.SampleSource
}

// The hooks package osmo set in its init, which has run by now: Go
// initializes an imported package first. A hook of the wrong type panics
// here, as this package is initialized.
var (
	newRollout        = hostlink.NewRollout.(func(string, hostlink.Runtime[osmo.Endpoint]) *osmo.Rollout)
	sources           = hostlink.Sources.(func(*osmo.Rollout) iter.Seq2[string, osmo.SampleSource])
	runWorkflow       = hostlink.RunWorkflow.(func(context.Context, *osmo.Workflow, *osmo.Rollout, *hostlink.Input[osmo.RolloutRequest]) error)
	toolsFor          = hostlink.ToolsFor.(func(*osmo.Workflow, *osmo.RolloutRequest) ([]osmo.Tool, error))
	loopSampleID      = hostlink.LoopSampleID.(func(*osmo.Workflow) string)
	newRolloutContext = hostlink.NewRolloutContext.(func(*osmo.Rollout, string, *osmo.RolloutRequest, []osmo.Tool) *osmo.RolloutContext)
)

// NewRollout binds a rollout id to its host's runtime. A nil runtime gives
// a rollout with no policy behind it (an empty Endpoint), the default
// logger and no metrics or event log: enough for a test whose workflow
// calls no LLM.
func NewRollout(id string, rt Runtime) *osmo.Rollout {
	return newRollout(id, rt)
}

// Run executes w for one rollout with r installed in ctx (where
// osmo.RolloutFromContext finds it). A panic becomes an *osmo.PanicError;
// returning without registering any sample source is osmo.ErrNoSamples: an
// empty success would train on nothing.
func Run(ctx context.Context, w *osmo.Workflow, r *osmo.Rollout, in *Input) error {
	// Input has hostlink.Input's fields in its order: the conversion shares
	// the value, and stops compiling if the two drift apart.
	return runWorkflow(ctx, w, r, (*hostlink.Input[osmo.RolloutRequest])(in))
}

// ToolsFor is what w offers a remote-rollout (G1) trainer for req, in the
// init's answer: an agent loop's GetTools (a panic becomes an error), or
// the tools the workflow declares.
func ToolsFor(w *osmo.Workflow, req *osmo.RolloutRequest) ([]osmo.Tool, error) {
	return toolsFor(w, req)
}

// LoopSampleID is the id of the one sample an osmo.AgentLoopWorkflow
// registers, known before it runs; "" for other workflows, whose samples
// are named as they run.
func LoopSampleID(w *osmo.Workflow) string { return loopSampleID(w) }

// Sources returns the sample sources registered on r so far, in
// registration order.
func Sources(r *osmo.Rollout) []Source {
	var out []Source
	for id, src := range sources(r) {
		out = append(out, Source{ID: id, Source: src})
	}
	return out
}

// ContextWithRollout returns ctx carrying r, as Run installs it: for a test
// of an integration that finds its rollout with osmo.RolloutFromContext
// without running a workflow.
func ContextWithRollout(ctx context.Context, r *osmo.Rollout) context.Context {
	return context.WithValue(ctx, hostlink.RolloutKey{}, r)
}

// NewRolloutContext is the context an agent loop runs with as sample
// sampleID of r: its Chat merges req's completion_params and offers tools,
// then posts to r's endpoint for the sample; its tool calls and events go
// to r. osmo.AgentLoopWorkflow builds one per rollout; a test of a loop
// builds one over a rollout whose runtime plays the policy.
func NewRolloutContext(r *osmo.Rollout, sampleID string, req *osmo.RolloutRequest, tools []osmo.Tool) *osmo.RolloutContext {
	return newRolloutContext(r, sampleID, req, tools)
}

// NewGraderContext builds a grader's context over the samples of a
// finished rollout, keyed by their ids.
func NewGraderContext(rolloutID string, samples []*osmo.Sample, label *string, metadata map[string]any) *osmo.GraderContext {
	gc := &osmo.GraderContext{
		RolloutID: rolloutID,
		Samples:   make(map[string]*osmo.Sample, len(samples)),
		Label:     label,
		Metadata:  metadata,
	}
	for _, s := range samples {
		gc.Samples[s.ID] = s
	}
	return gc
}
