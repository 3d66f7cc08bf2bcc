package grader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime/debug"
	"strings"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// errShutdown marks a grading cut short by Close: no verdict, so it is
// neither stored nor answered, and the client's resend is graded elsewhere.
var errShutdown = errors.New("grader service is shutting down")

// panicError is a grader panic turned into an error.
type panicError struct {
	value any
	stack []byte
}

func (e *panicError) Error() string { return fmt.Sprintf("panicked: %v", e.value) }

// run grades samples ids of req with g. A grader that does not give every
// sample a finite reward or the remove flag makes a failed grading; only a
// shutdown is an error.
func (s *Service) run(tctx context.Context, name string, g osmo.Grader, req *request, ids []string, log *slog.Logger) (gr *grading, err error) {
	gc, err := graderContext(req, ids)
	if err != nil {
		// A message, metadata or extra fields that are no JSON object.
		gr = &grading{RolloutID: req.GetRolloutId(), Grader: name, GradedAt: time.Now(), Category: outcome.Validation}
		gr.fail(ids, err)
		return gr, nil
	}
	sctx, span := s.startRun(s.ctx, tctx, name, len(ids))
	defer func() {
		endRun(span, gr, err)
		span.End()
	}()
	select {
	case s.slots <- struct{}{}:
	case <-s.ctx.Done():
		return nil, errShutdown
	}
	timeout := s.cfg.Timeout
	if t := req.GetTimeout(); t != nil && t.AsDuration() > 0 && t.AsDuration() < timeout {
		timeout = t.AsDuration()
	}
	ctx, cancel := context.WithTimeout(sctx, timeout)
	defer cancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		// Released when the grader really returns: MaxConcurrent bounds the
		// graders running, including ones that ignore their context.
		defer func() { <-s.slots }()
		done <- callGrader(ctx, g, gc)
	}()
	select {
	case err = <-done:
	case <-ctx.Done():
		select {
		case err = <-done: // it returned just in time
		default:
			err = ctx.Err()
			if s.ctx.Err() == nil {
				log.WarnContext(ctx, "grader did not return by its deadline; abandoning it", "grader", name)
			}
		}
	}
	if err != nil && s.ctx.Err() != nil {
		return nil, errShutdown
	}
	elapsed := time.Since(start)

	gr = &grading{RolloutID: req.GetRolloutId(), Grader: name, GradedAt: time.Now()}
	switch {
	case err == nil:
		if err = collect(gc, ids, gr); err != nil {
			gr.Category = outcome.Validation
		}
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		err = fmt.Errorf("timed out after %s", timeout)
		gr.Category = outcome.Timeout
	default:
		// A grader is user code: its failure is the agent's kind.
		gr.Category = outcome.Agent
	}
	if err != nil {
		if p, ok := errors.AsType[*panicError](err); ok {
			log.ErrorContext(ctx, "grader panicked", "grader", name, "panic", p.value, "stack", string(p.stack))
		}
		gr.fail(ids, err)
		log.WarnContext(ctx, "grading failed", "grader", name, "samples", len(ids), "duration_ms", elapsed.Milliseconds(), "error", gr.Error)
		return gr, nil
	}
	for _, r := range gr.Samples {
		log.DebugContext(ctx, "sample graded", "sample_id", r.ID, "reward", r.Reward, "remove_sample", r.Remove)
	}
	return gr, nil
}

// fail makes gr a failed grading of ids, without outcomes.
func (gr *grading) fail(ids []string, err error) {
	gr.Error = fmt.Sprintf("grader %q: %v", gr.Grader, err)
	gr.Samples = make([]sampleResult, len(ids))
	for i, id := range ids {
		gr.Samples[i] = sampleResult{ID: id}
	}
}

// callGrader runs g, turning a panic into an error: one bad grader must not
// take the service down.
func callGrader(ctx context.Context, g osmo.Grader, gc *osmo.GraderContext) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &panicError{value: p, stack: debug.Stack()}
		}
	}()
	if err := g.Grade(ctx, gc); err != nil {
		return fmt.Errorf("failed: %w", err)
	}
	return nil
}

// collect reads each sample's outcome out of gc into gr. A sample with
// neither a reward nor the remove flag, or a non-finite reward, fails the
// whole grading: rewards must never default to 0.
func collect(gc *osmo.GraderContext, ids []string, gr *grading) error {
	var ungraded []string
	gr.Samples = make([]sampleResult, 0, len(ids))
	for _, id := range ids {
		r := sampleResult{ID: id, Remove: gc.Removed(id)}
		if v, ok := gc.Reward(id); ok {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return fmt.Errorf("set a non-finite reward %v on sample %q", v, id)
			}
			r.Reward = &v
		} else if !r.Remove {
			ungraded = append(ungraded, fmt.Sprintf("%q", id))
		}
		gr.Samples = append(gr.Samples, r)
	}
	if len(ungraded) > 0 {
		return fmt.Errorf("left samples without a reward or remove_sample: %s", strings.Join(ungraded, ", "))
	}
	return nil
}
