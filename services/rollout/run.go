package rollout

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/host"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// workflowGrace is how long a workflow may take to return once its
// context ended before the rollout is reported without it.
const workflowGrace = time.Second

// run runs the workflow in this goroutine, in the rollout's slot (release
// gives it back), collects its samples, and hands how the run ended to
// then, once. A workflow that ignores its context ending for workflowGrace
// is abandoned: then is called from another goroutine, while this one keeps
// the slot until the workflow returns, so the limit bounds what runs.
func (s *Service) run(rec *record, log *slog.Logger, release func(), then func(outcome.Outcome)) {
	ctx, cancel := context.WithCancel(rec.traced(rec.runCtx))
	defer cancel()
	if rec.fromAdmission {
		// The budget counts from acceptance: time queued comes out of it.
		ctx, cancel = s.budgetContext(ctx, rec.created.Add(rec.budget))
		defer cancel()
	}

	queued := rec.created
	if ctx.Err() != nil {
		release()
		then(s.interrupted(rec, ctx, "while the rollout was queued"))
		return
	}
	if !rec.startRunning() {
		// Cancelled while it was queued.
		release()
		then(outcome.CancelledBy("cancelled by request while queued"))
		return
	}
	rec.rolloutSpan().AddEvent("started", trace.WithAttributes(osmoattr.QueueWait.Float64(ms(time.Since(queued)))))
	rec.log.write("start", map[string]any{"queued_ms": ms(time.Since(queued))})
	s.running.Add(1)
	s.metrics.running.Inc()
	// The slot is for the workflow: grading and callbacks do not hold it.
	freeSlot := func() {
		release()
		s.running.Add(-1)
		s.metrics.running.Dec()
	}
	if !rec.fromAdmission {
		ctx, cancel = s.budgetContext(ctx, time.Now().Add(rec.budget))
		defer cancel()
	}

	route := rec.upstream
	route.Model, route.ClientToken, route.Context = s.cfg.Model, rec.token, ctx
	s.routes.Set(rec.id, route)
	if s.cfg.Policy.Engines == nil && route.BaseURL != "" && (s.cfg.Engines == nil || !s.cfg.EnginesOwnRouting) {
		// A policy server the trainer named serves this rollout's calls:
		// pauses go to it.
		s.upstreams.add(route.BaseURL)
	}
	r := osmo.Hosting().NewRollout(rec.id, &workflowRuntime{s: s, rec: rec, log: log})
	agentCtx, span := s.startSpan(ctx, "invoke_agent "+rec.workflow, trace.SpanKindInternal,
		semconv.GenAIOperationNameInvokeAgent, semconv.GenAIAgentName(rec.workflow))
	conclude := func(runErr error) outcome.Outcome {
		s.routes.Delete(rec.id)
		if s.cfg.Engines != nil {
			// Its samples make no more calls: their engines' slots are free.
			s.cfg.Engines.Forget(rec.id)
		}
		o := s.ended(rec, ctx, r, runErr, log)
		if !o.OK() {
			fail(span, string(o.Category), o.Message)
		}
		span.End()
		return o
	}

	// Read before the watchdog is armed: freeze may follow it.
	in := rec.in
	// concluded: the run was reported, by this goroutine or the watchdog.
	var concluded atomic.Bool
	var watchdog atomic.Pointer[time.Timer]
	stopWatching := context.AfterFunc(agentCtx, func() {
		watchdog.Store(time.AfterFunc(workflowGrace, func() {
			if !concluded.CompareAndSwap(false, true) {
				return
			}
			log.Error("workflow ignores its context; abandoned it", "grace", workflowGrace)
			err := fmt.Errorf("workflow did not return within %s of its context ending (abandoned): %w", workflowGrace, context.Cause(agentCtx))
			// This goroutine still counts in s.wg: it cannot reach zero.
			s.wg.Go(func() { then(conclude(err)) })
		}))
	})
	runErr := host.Run(agentCtx, s.workflow, r, in)
	stopWatching()
	if t := watchdog.Load(); t != nil {
		t.Stop()
	}
	freeSlot()
	if concluded.CompareAndSwap(false, true) {
		then(conclude(runErr))
	}
}

// ended is how a run ended, and collects the samples, even of a failed
// run.
func (s *Service) ended(rec *record, ctx context.Context, r *osmo.Rollout, runErr error, log *slog.Logger) outcome.Outcome {
	o := outcome.Success()
	switch {
	case runErr != nil:
		o = s.classify(rec, ctx, runErr)
		var p *osmo.PanicError
		if errors.As(runErr, &p) {
			log.Error("workflow panicked", "panic", p.Value, "stack", string(p.Stack))
		}
	case errors.Is(context.Cause(rec.runCtx), errCancelled):
		// Returned after a cancel the trainer was told of.
		o = outcome.CancelledBy("cancelled by request")
	}
	if err := s.collect(rec, r); err != nil && o.OK() {
		o = outcome.Failed(outcome.Agent, "%v", err)
	}
	o = s.checkStale(rec, o, log)
	if !o.OK() {
		log.Warn("workflow failed", "category", o.Category, "error", o.Message)
	}
	return o
}

// interrupted is the outcome of a rollout whose run context ended first:
// cancelled by request, out of time, or cut short by the shutdown, which is
// a failure (agent_error): v0.2's vocabulary has no "cancelled", and the
// trainer did not ask for it.
func (s *Service) interrupted(rec *record, ctx context.Context, when string) outcome.Outcome {
	switch {
	case errors.Is(context.Cause(rec.runCtx), errCancelled):
		return outcome.CancelledBy("cancelled by request %s", when)
	case errors.Is(context.Cause(ctx), context.DeadlineExceeded):
		return outcome.Failed(outcome.Timeout, "timed out: %s (%s) ran out %s", rec.budgetName, rec.budget, when)
	}
	return outcome.Failed(outcome.Agent, "cancelled by the server shutting down %s", when)
}

// classify names a workflow's error's category.
func (s *Service) classify(rec *record, ctx context.Context, err error) outcome.Outcome {
	switch {
	case ctx.Err() != nil:
		return s.interrupted(rec, ctx, "while the workflow ran: "+err.Error())
	case errors.Is(err, osmo.ErrInvalidInput):
		return outcome.Failed(outcome.Validation, "%v", err)
	case errors.Is(err, osmo.ErrTimeout):
		return outcome.Failed(outcome.Timeout, "%v", err)
	case rec.lastCallFailedUpstream():
		return outcome.Failed(outcome.HTTP, "%v", err)
	}
	return outcome.Failed(outcome.Agent, "%v", err)
}

// lastCallFailedUpstream reports whether the last LLM call failed with an
// HTTP error from the policy.
func (r *record) lastCallFailedUpstream() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.calls) == 0 {
		return false
	}
	c := r.calls[len(r.calls)-1]
	return c.Error != "" && c.StatusCode >= 400
}
