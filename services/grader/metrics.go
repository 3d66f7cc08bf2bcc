package grader

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the grader service's Prometheus collectors.
type metrics struct {
	gradings *prometheus.CounterVec
	duration *prometheus.HistogramVec
	rewards  *prometheus.HistogramVec
	cached   prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		gradings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_grader_gradings_total",
			Help: "Gradings run, by grader and outcome (ok or error). Cached answers are not gradings.",
		}, []string{"grader", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "osmo_grader_duration_seconds",
			Help:    "Wall time of one grading (one rollout's samples), by grader and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10),
		}, []string{"grader", "outcome"}),
		rewards: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "osmo_grader_reward",
			Help:    "Rewards set on samples, by grader.",
			Buckets: []float64{-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1},
		}, []string{"grader"}),
		cached: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "osmo_grader_cached_answers_total",
			Help: "Samples answered from an earlier grading of the same content (resends after reconnects or restarts).",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.gradings, m.duration, m.rewards, m.cached)
	}
	return m
}

// observe records one finished grading.
func (m *metrics) observe(gr *grading, elapsed time.Duration) {
	result := "ok"
	if gr.Error != "" {
		result = "error"
	}
	m.gradings.WithLabelValues(gr.Grader, result).Inc()
	m.duration.WithLabelValues(gr.Grader, result).Observe(elapsed.Seconds())
	for _, r := range gr.Samples {
		if r.Reward != nil {
			m.rewards.WithLabelValues(gr.Grader).Observe(*r.Reward)
		}
	}
}
