package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/types/known/durationpb"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// grade sends the rollout's samples to the grader and sets their rewards;
// it returns the final outcome. Grading has its own budget and survives
// shutdown: the samples are finished work.
func (s *Service) grade(rec *record, log *slog.Logger) outcome.Outcome {
	ctx, cancel := context.WithTimeout(rec.traced(rec.gradeCtx), rec.gradeBudget)
	defer cancel()
	ctx, span := s.startSpan(ctx, "grade", trace.SpanKindClient, osmoattr.GraderName.String(s.cfg.GraderName))
	defer span.End()
	start := time.Now()
	samples, err := json.Marshal(rec.snapshot())
	if err != nil {
		return outcome.Failed(outcome.Agent, "grading failed: encode the samples: %v", err)
	}
	resp, err := s.cfg.Grader.Grade(ctx, &graderv1.GradeRequest{
		RolloutId:    rec.id,
		SamplesJson:  samples,
		Label:        rec.label,
		MetadataJson: rec.metadata,
		Grader:       s.cfg.GraderName,
		Timeout:      durationpb.New(rec.gradeBudget),
		// Graded once, by the replica that ran it: nothing can be stored
		// yet. The grader client clears this on a resend.
		FirstAttempt: true,
	})
	var o outcome.Outcome
	switch {
	case err != nil && errors.Is(context.Cause(rec.gradeCtx), errCancelled):
		o = outcome.CancelledBy("cancelled by request while grading")
	case err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		o = outcome.Failed(outcome.Timeout, "grading failed: the grader did not answer within grader_timeout_sec (%s)", rec.gradeBudget)
	case err != nil:
		o = outcome.Failed(outcome.Grader, "grading failed: %v", err)
	case resp.GetError() != "":
		o = outcome.Failed(outcome.Parse(resp.GetErrorCategory()), "grading failed: %s", resp.GetError())
	default:
		if msg := rec.applyGrades(resp); msg != "" {
			o = outcome.Failed(outcome.Validation, "grading failed: grader %q %s", resp.GetGrader(), msg)
		} else {
			o = outcome.Success()
		}
	}
	took := time.Since(start)
	if !o.OK() {
		s.metrics.gradeDuration.WithLabelValues("error").Observe(took.Seconds())
		rec.log.write("grade_error", map[string]any{"error": o.Message, "category": o.Category})
		fail(span, string(o.Category), o.Message)
		log.WarnContext(ctx, "grading failed", "category", o.Category, "error", o.Message)
		return o
	}
	s.metrics.gradeDuration.WithLabelValues("ok").Observe(took.Seconds())
	cached, removed := 0, 0
	for _, g := range resp.GetGrades() {
		if g.GetCached() {
			cached++
		}
		if g.GetRemoveSample() {
			removed++
		}
	}
	rec.mu.Lock()
	reward := meanReward(rec.samples)
	rec.mu.Unlock()
	if span.IsRecording() {
		span.SetAttributes(osmoattr.GraderName.String(resp.GetGrader()),
			osmoattr.GradeCached.Bool(cached == len(resp.GetGrades())), osmoattr.RemoveSample.Bool(removed > 0))
		if reward != nil {
			span.SetAttributes(osmoattr.Reward.Float64(*reward))
		}
	}
	rec.log.write("graded", map[string]any{
		"reward": reward, "grader": resp.GetGrader(), "duration_ms": ms(took),
		"samples": len(resp.GetGrades()), "cached": cached, "removed": removed,
	})
	log.InfoContext(ctx, "graded", "reward", reward, "grader", resp.GetGrader())
	return o
}

// applyGrades sets the grader's rewards on the samples, or reports what is
// wrong with its answer and sets none: every sample needs a finite reward
// or remove_sample.
func (r *record) applyGrades(resp *graderv1.GradeResponse) string {
	grades := map[string]*graderv1.SampleGrade{}
	for _, g := range resp.GetGrades() {
		grades[g.GetSampleId()] = g
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var bad []string
	for _, sm := range r.samples {
		g := grades[sm.ID]
		switch {
		case g == nil:
			bad = append(bad, fmt.Sprintf("%q (no grade)", sm.ID))
		case g.Reward != nil && (math.IsNaN(g.GetReward()) || math.IsInf(g.GetReward(), 0)):
			bad = append(bad, fmt.Sprintf("%q (non-finite reward %v)", sm.ID, g.GetReward()))
		case g.Reward == nil && !g.GetRemoveSample():
			bad = append(bad, fmt.Sprintf("%q (neither a reward nor remove_sample)", sm.ID))
		}
	}
	if len(bad) > 0 {
		return "left samples without a finite reward: " + strings.Join(bad, ", ")
	}
	for _, sm := range r.samples {
		g := grades[sm.ID]
		sm.Reward, sm.RemoveSample = g.Reward, g.GetRemoveSample()
	}
	return ""
}
