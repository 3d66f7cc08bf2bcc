package rollout

import (
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// What a stale rollout gets (PolicySettings.StaleAction).
const (
	StaleFlag   = "flag"   // "stale": true on the record, its rows and metrics
	StaleCancel = "cancel" // cancelled, error category stale_policy
)

// stalenessMetrics count how far behind the policy rollouts finish.
type stalenessMetrics struct {
	lag   prometheus.Histogram
	stale *prometheus.CounterVec
}

func newStalenessMetrics(reg prometheus.Registerer) *stalenessMetrics {
	f := promauto.With(reg)
	m := &stalenessMetrics{
		lag: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "osmo_rollout_policy_version_lag",
			Help:    "Policy versions between a finished rollout's oldest LLM call and the current version, per rollout whose calls went upstream.",
			Buckets: []float64{0, 1, 2, 3, 4, 6, 8, 12, 16, 32},
		}),
		stale: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_rollouts_stale_total",
			Help: "Rollouts whose oldest LLM call was more than --max-staleness versions behind when they finished, by what was done (flag, cancel).",
		}, []string{"action"}),
	}
	for _, a := range []string{StaleFlag, StaleCancel} {
		m.stale.WithLabelValues(a)
	}
	return m
}

// checkStale notes the span of versions of rec's calls and, with a
// staleness limit, flags or cancels a rollout whose oldest call is too far
// behind the version in force now. A rollout that failed already keeps its
// failure and is flagged.
func (s *Service) checkStale(rec *record, o outcome.Outcome, log *slog.Logger) outcome.Outcome {
	rec.mu.Lock()
	span := versionSpan(rec.calls)
	rec.versions = span
	rec.mu.Unlock()
	if span == nil {
		return o
	}
	current := s.policy.gate.Version()
	lag := current - span.Min
	s.staleness.lag.Observe(float64(lag))
	action, limit := s.cfg.Policy.StaleAction, s.cfg.Policy.MaxStaleness
	if action == "" || lag <= limit {
		return o
	}
	s.staleness.stale.WithLabelValues(action).Inc()
	log.Warn("stale rollout", "oldest_version", span.Min, "current_version", current, "max_staleness", limit, "action", action)
	if action == StaleCancel && o.OK() {
		return outcome.Outcome{State: rolloutv1.State_STATE_CANCELLED, Category: outcome.StalePolicy,
			Message: fmt.Sprintf("stale: its oldest LLM call was answered by policy version %d, %d behind the current %d (--max-staleness %d)", span.Min, lag, current, limit)}
	}
	rec.mu.Lock()
	rec.stale = true
	rec.mu.Unlock()
	return o
}
