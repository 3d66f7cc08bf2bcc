package rollout_test

import (
	"context"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/services/rollout"
)

// TestQueueOrderAndBound: rollouts wait for a slot in the order they were
// admitted. The queue's bound counts what waits; a cancelled rollout's
// place is free at once; a duplicate start of a waiting one queues
// nothing more. (The default state is private: its queue is in process.)
func TestQueueOrderAndBound(t *testing.T) {
	ctx := context.Background()
	b := newBlockingWorkflow()
	h := newHarness(t, harnessOpts{wf: b.workflow(t), cfg: func(c *rollout.Config) { c.MaxConcurrent, c.MaxQueued = 1, 3 }})
	cancel := func(id, want string) {
		t.Helper()
		resp, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{id}})
		if err != nil || resp.GetDispositions()[id] != want {
			t.Fatalf("cancel %s: %v %v, want %s", id, resp, err, want)
		}
	}
	h.start(t, h.startReq(t, "o-1"))
	b.waitStarted(t, "o-1")
	for _, id := range []string{"o-2", "o-3", "o-4", "o-2"} {
		h.start(t, h.startReq(t, id))
	}
	h.waitHealth(t, "3 queued", func(c *rolloutv1.Concurrency) bool { return c.GetQueued() == 3 })
	if _, err := h.client.StartRollout(ctx, h.startReq(t, "o-5")); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fourth start to wait under a bound of 3: %v, want ResourceExhausted", err)
	}
	cancel("o-3", "cancelled_queued")
	h.waitHealth(t, "2 queued", func(c *rolloutv1.Concurrency) bool { return c.GetQueued() == 2 })
	h.start(t, h.startReq(t, "o-5"))

	prev := "o-1"
	for _, next := range []string{"o-2", "o-4", "o-5"} {
		cancel(prev, "cancelled_running")
		b.waitStarted(t, next)
		prev = next
	}
	cancel(prev, "cancelled_running")
	for _, id := range []string{"o-1", "o-2", "o-3", "o-4", "o-5"} {
		h.waitDone(t, id)
		if n := len(h.g2.Completions(id)); n != 1 {
			t.Errorf("%s: %d completions, want 1", id, n)
		}
	}
	if ran := b.ran(); !slices.Equal(ran, []string{"o-1", "o-2", "o-4", "o-5"}) {
		t.Errorf("workflows ran for %v, want o-1, o-2, o-4, o-5 in that order", ran)
	}
}
