package graders

import (
	"errors"
	"strings"

	"github.com/osmo-rl/osmo"
)

var _ osmo.RewardFunc = Calculator

// Calculator is the reward of the calculator agent (an osmo.RewardFunc):
// 1.0 when the solution contains the ground truth, else 0.0. The ground
// truth is the trimmed label or, when the label is a worked GSM8K answer,
// the part after its "####". A solution whose own "####" answer equals the
// ground truth, as text or as a number ("42.0" for "42"), also scores 1.0.
// A blank ground truth is an error: every solution would contain it.
// extra (the row's metadata) is not used.
func Calculator(solution, groundTruth string, extra map[string]any) (float64, error) {
	want := strings.TrimSpace(groundTruth)
	if after, ok := finalAnswer(groundTruth); ok {
		want = after
	}
	if want == "" {
		return 0, errors.New("graders.Calculator: ground truth is blank")
	}
	if strings.Contains(solution, want) {
		return 1, nil
	}
	if got, ok := finalAnswer(solution); ok && sameAnswer(got, want) {
		return 1, nil
	}
	return 0, nil
}
