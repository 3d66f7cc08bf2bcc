package osmo

import (
	"context"

	"github.com/osmo-rl/osmo/internal/hostlink"
)

// Package host runs workflows through these: they stay unexported here
// because workflow and grader authors never call them.
func init() {
	hostlink.NewRollout = newRollout
	hostlink.Sources = (*Rollout).registered
	hostlink.RunWorkflow = func(ctx context.Context, w *Workflow, r *Rollout, in *workflowInput) error {
		return w.execute(ctx, r, in)
	}
	hostlink.ToolsFor = (*Workflow).toolsFor
	hostlink.LoopSampleID = (*Workflow).loopSampleID
	hostlink.NewRolloutContext = newRolloutContext
}
