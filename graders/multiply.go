package graders

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/osmo-rl/osmo"
)

// MultiplyGrader is the grader of the multiply workflow (the MultiplyGrader
// of the Osmosis OpenAI Agents guide): every sample scores 1.0 when its last
// assistant text contains the trimmed label, else 0.0.
//
// Unlike the other built-ins it does not fail without a label: as in the
// guide, a rollout whose label is missing or blank rewards every sample 0.0,
// since no answer can be shown right.
type MultiplyGrader struct{}

var _ osmo.Grader = MultiplyGrader{}

// Grade implements osmo.Grader. It sets a reward on every sample.
func (MultiplyGrader) Grade(ctx context.Context, gc *osmo.GraderContext) error {
	label := ""
	if gc.Label != nil {
		label = strings.TrimSpace(*gc.Label)
	}
	for _, id := range slices.Sorted(maps.Keys(gc.Samples)) {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("graders: multiply: %w", err)
		}
		reward := 0.0
		if s := gc.Samples[id]; s != nil && label != "" && strings.Contains(osmo.LastAssistantText(s.Messages), label) {
			reward = 1
		}
		if err := gc.SetSampleReward(id, reward); err != nil {
			return fmt.Errorf("graders: multiply: %w", err)
		}
	}
	return nil
}
