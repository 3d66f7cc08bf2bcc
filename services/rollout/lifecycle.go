package rollout

import (
	"log/slog"
	"time"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// process takes an admitted rollout through the rest of its life, the same
// for every wire: wait for a slot and run the workflow, collect its
// samples, deliver what the wire owes once the run ended, grade, deliver
// what it owes once the outcome is final, and finish. It runs in the
// rollout's own goroutine.
func (s *Service) process(rec *record) {
	log := s.log.With("rollout_id", rec.id, "wire", rec.wire.name())
	s.run(rec, log, func(run outcome.Outcome) { s.conclude(rec, run, log) })
}

// conclude is the rest of a rollout's life once its run ended.
func (s *Service) conclude(rec *record, run outcome.Outcome, log *slog.Logger) {
	defer func() {
		if err := rec.log.close(); err != nil {
			log.Warn("event log", "error", err)
		}
	}()
	final := run
	// The status a trainer reads when a callback arrives already says what
	// that callback says: final, or grading.
	grading := run.OK() && s.cfg.Grader != nil && rec.gradable
	if grading {
		rec.setState(rolloutv1.State_STATE_GRADING)
	} else {
		if run.OK() {
			rec.log.write("grading_skipped", map[string]any{
				"has_grader": s.cfg.Grader != nil, "has_label": rec.label != nil, "has_metadata": rec.metadata != nil,
			})
		}
		rec.settle(run)
	}
	// Grading goes on while the first callbacks are logged and delivered:
	// a result is in the state log as soon as it is graded, even when the
	// trainer is not answering, and the second callbacks still follow the
	// first.
	ran := rec.wire.ran(rec, run)
	delivered := make(chan struct{})
	go func() {
		defer close(delivered)
		s.deliver(rec, stageRan, run, ran, log)
	}()
	if grading {
		final = s.grade(rec, log)
		rec.settle(final)
	}
	fin := rec.wire.finished(rec, run, final)
	s.owe(rec, stageFinal, final, fin, log)
	<-delivered
	s.redeliver(rec, stageFinal, fin, nil, log)
	s.finish(rec, final, log)
}

// finish marks the rollout finished once its callbacks are delivered (or
// given up on), counts it, freezes its record and tells watchers.
func (s *Service) finish(rec *record, o outcome.Outcome, log *slog.Logger) {
	rec.mu.Lock()
	rec.finished = time.Now()
	reward := rec.reward
	owed := rec.undelivered
	rec.mu.Unlock()
	word := rec.wire.statusWord(o)
	s.completed.Add(1)
	s.metrics.finished.WithLabelValues(word, string(o.Category)).Inc()
	s.metrics.duration.WithLabelValues(word).Observe(time.Since(rec.created).Seconds())
	if reward != nil {
		s.metrics.rewards.Observe(*reward)
	}
	log.Info("rollout finished", "status", word, "category", o.Category, "reward", reward)
	endRolloutSpan(rec, word, o)
	if owed && s.state != nil {
		log.Warn("state log: a callback stopped by the shutdown stays owed; the next start delivers it")
	} else if err := s.state.finished(rec); err != nil {
		log.Error("state log: could not record the rollout finished", "error", err)
	}
	s.store.finish(rec, rec.freeze())
}
