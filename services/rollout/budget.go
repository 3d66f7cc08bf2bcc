package rollout

import (
	"context"
	"time"
)

// budgetContext ends with cause context.DeadlineExceeded once the time up
// to deadline has run out, not counting the time the policy was paused
// meanwhile: a weight update holds the rollout's LLM calls, and that wait
// is not the agent's. (A context's deadline cannot move, so this one has
// none; its end is read with context.Cause.)
func (s *Service) budgetContext(parent context.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	g := s.policy.gate
	base := g.PausedTotal()
	left := func() time.Duration { return time.Until(deadline.Add(g.PausedTotal() - base)) }
	if left() <= 0 {
		cancel(context.DeadlineExceeded)
		return ctx, func() { cancel(context.Canceled) }
	}
	var timer *time.Timer
	made := make(chan struct{})
	timer = time.AfterFunc(left(), func() {
		<-made
		if ctx.Err() != nil {
			return
		}
		// While paused the end moves as fast as time passes: look again
		// when it would come.
		if d := left(); d > 0 {
			timer.Reset(d)
			return
		}
		cancel(context.DeadlineExceeded)
	})
	close(made)
	return ctx, func() {
		timer.Stop()
		cancel(context.Canceled)
	}
}
