// Package osmotest runs workflows, agent loops and graders in a test,
// without a rollout service.
//
// A test builds a rollout over an osmo.Runtime of its own (NewRollout; its
// Endpoint says where each sample's LLM calls go), runs a workflow on it
// (Run) and reads the sample sources the workflow registered (Sources). A
// test of an integration that finds its rollout with
// osmo.RolloutFromContext installs one with ContextWithRollout; a test of
// an agent loop builds the loop's context with NewRolloutContext; a test of
// a grader builds its context with NewGraderContext.
package osmotest

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/host"
)

// Input is one rollout's input, as the rollout service hands it to a
// workflow: RolloutID, Prompt, Metadata, Label (nil when the row has none;
// it reaches only osmo.LabelReaders) and, for a remote-rollout (G1)
// request, the Request and the Tools the workflow offered for it, which
// an osmo.AgentLoopWorkflow hands to its loop.
type Input = host.Input

// Source is a sample source a workflow registered, and its sample id.
type Source struct {
	ID     string
	Source osmo.SampleSource
}

// NewRollout binds a rollout id to a runtime. A nil runtime gives a rollout
// with no policy behind it (an empty Endpoint), the default logger and no
// metrics or event log: enough for a workflow that calls no LLM.
func NewRollout(id string, rt osmo.Runtime) *osmo.Rollout {
	return osmo.Hosting().NewRollout(id, rt)
}

// Run executes w for one rollout as the rollout service does: with r in
// ctx (where osmo.RolloutFromContext finds it), a panic turned into an
// *osmo.PanicError, and osmo.ErrNoSamples when w registered no sample
// source.
func Run(ctx context.Context, w *osmo.Workflow, r *osmo.Rollout, in *Input) error {
	return host.Run(ctx, w, r, in)
}

// Sources returns the sample sources registered on r so far, in
// registration order.
func Sources(r *osmo.Rollout) []Source {
	var out []Source
	for id, src := range osmo.Hosting().Sources(r) {
		out = append(out, Source{ID: id, Source: src})
	}
	return out
}

// ContextWithRollout returns ctx carrying r, as Run installs it: for a test
// of an integration that finds its rollout with osmo.RolloutFromContext
// without running a workflow.
func ContextWithRollout(ctx context.Context, r *osmo.Rollout) context.Context {
	return osmo.Hosting().ContextWithRollout(ctx, r)
}

// NewRolloutContext is the context an agent loop runs with as sample
// sampleID of r: its Chat merges req's completion_params and offers tools,
// then posts to r's endpoint for the sample; its tool calls and events go
// to r. A test of a loop builds one over a rollout whose runtime plays the
// policy.
func NewRolloutContext(r *osmo.Rollout, sampleID string, req *osmo.RolloutRequest, tools []osmo.Tool) *osmo.RolloutContext {
	return osmo.Hosting().NewRolloutContext(r, sampleID, req, tools)
}

// NewGraderContext builds a grader's context over the samples of a
// finished rollout, keyed by their ids, as the grader service does.
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

// Messages reads src's conversation as osmo messages: SampleMessages
// decoded, as a grader is given them. nil stays nil.
func Messages(src osmo.SampleSource) ([]osmo.Message, error) {
	raw, err := src.SampleMessages()
	if err != nil || raw == nil {
		return nil, err
	}
	out := make([]osmo.Message, len(raw))
	for i, m := range raw {
		if err := json.Unmarshal(m, &out[i]); err != nil {
			return nil, fmt.Errorf("osmotest: message %d: %w", i, err)
		}
	}
	return out, nil
}
