package e2e

import (
	"net/http"
	"testing"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestReusedRolloutIDIsGradedOnItsOwnGroundTruth reuses a rollout id once
// osmo serve has pruned the first rollout's record: the grader still
// remembers that rollout's grading (its results outlive the record, in
// the gradings bucket), yet the new rollout must be rewarded for its own
// ground truth, not answered the old reward.
func TestReusedRolloutIDIsGradedOnItsOwnGroundTruth(t *testing.T) {
	s := startG1Env(t, []string{"OSMOSIS_ROLLOUT_SERVER_CLEANUP_INTERVAL_SECONDS=0.05"}, controller.Options{},
		"--record-ttl", "300ms")
	const id = "q1"
	rollout := func(truth string, n int) controller.Completion {
		t.Helper()
		if code, body := s.init(t, id, "What is 2 * 3?", truth); code != http.StatusAccepted {
			t.Fatalf("init %s (ground truth %s): %d %v", id, truth, code, body)
		}
		waitFor(t, "completion", func() bool { return len(s.ctl.Completions(id)) >= n })
		cs := s.ctl.Completions(id)
		if len(cs) != n {
			t.Fatalf("%d completions of %s, want %d", len(cs), id, n)
		}
		return cs[n-1]
	}
	pruned := func() {
		t.Helper()
		waitFor(t, "the record to be pruned", func() bool {
			req, _ := http.NewRequest("GET", s.base+"/v1/rollouts/"+id, nil)
			req.Header.Set("Authorization", "Bearer "+serverKey)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusNotFound
		})
	}

	for i, tc := range []struct {
		truth  string
		reward float64
	}{{"6", 1}, {"999", 0}, {"6", 1}} {
		if i > 0 {
			pruned()
		}
		c := rollout(tc.truth, i+1)
		if c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != tc.reward {
			t.Fatalf("rollout %d of %s (ground truth %s): %s, want reward %v", i+1, id, tc.truth, c.Raw, tc.reward)
		}
	}
}
