// Package host is how the rollout service runs a workflow: the input it
// hands one, kept on the rollout's record until the run. The rest of what
// a host needs (building a rollout over its runtime, reading what the
// workflow registered, an agent loop's tools and sample id) is
// osmo.Hosting().
package host

import (
	"context"

	"github.com/osmo-rl/osmo"
)

// Input is one rollout's input, as the rollout service hands it to a
// workflow.
type Input struct {
	RolloutID string
	Prompt    []osmo.Message
	Metadata  map[string]any
	// Label is the row's label (ground truth), nil when it has none. It
	// reaches only workflows that are osmo.LabelReaders.
	Label *string
	// Request is the remote-rollout (G1) request the input came from, and
	// Tools what the workflow offered for it (osmo.Hosting().ToolsFor);
	// both nil for rollouts started otherwise. An osmo.AgentLoopWorkflow
	// hands them to its loop.
	Request *osmo.RolloutRequest
	Tools   []osmo.Tool
}

// Run executes w for one rollout with r installed in ctx (where
// osmo.RolloutFromContext finds it). A panic becomes an *osmo.PanicError;
// returning without registering any sample source is osmo.ErrNoSamples: an
// empty success would train on nothing.
func Run(ctx context.Context, w *osmo.Workflow, r *osmo.Rollout, in *Input) error {
	return osmo.Hosting().Run(ctx, w, r, in.RolloutID, in.Prompt, in.Metadata, in.Label, in.Request, in.Tools)
}
