package llmproxy

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the proxy's own Prometheus collectors; nil when Config.Metrics
// is nil, and every method is a no-op on nil.
type metrics struct {
	requests *prometheus.CounterVec
	added    prometheus.Histogram
	attempts *prometheus.CounterVec
}

// Outcomes of one upstream attempt (osmo_llmproxy_upstream_attempts_total).
const (
	attemptOK        = "ok"        // a 2xx answer relayed to the client
	attemptRejected  = "rejected"  // a non-2xx, non-5xx answer (a 4xx) passed through
	attemptHTTP5xx   = "http_5xx"  // a 5xx answer
	attemptTimeout   = "timeout"   // no answer within the per-attempt timeout
	attemptTransport = "transport" // connection refused, reset, ...
	attemptMalformed = "malformed" // a body that is not a chat completion
	attemptTooLarge  = "too_large" // larger than MaxResponseBytes
	attemptAborted   = "aborted"   // the client left or the rollout ended mid-attempt
	attemptBadRoute  = "invalid_route"
	// attemptPaused is an attempt an abort pause cut; it is made again
	// after the resume.
	attemptPaused = "paused"
	// attemptTokensRefused is a 400 or 422 to a call asking for token ids,
	// asked again at once without them.
	attemptTokensRefused = "tokens_refused"
)

func newMetrics(reg prometheus.Registerer) *metrics {
	if reg == nil {
		return nil
	}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llmproxy_requests_total",
			Help: "Requests the LLM proxy answered, by HTTP status (499: the client went away first).",
		}, []string{"code"}),
		added: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "osmo_llmproxy_added_latency_seconds",
			Help:    "The proxy's own time per chat completion: wall time minus the time spent waiting on the upstream and between retries (Server-Timing proxy;dur).",
			Buckets: []float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1},
		}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llmproxy_upstream_attempts_total",
			Help: "Upstream attempts by outcome: ok, rejected (4xx passed through), tokens_refused (a 400 or 422 to a call asking for token ids, asked again without them), http_5xx, timeout, transport, malformed, too_large, aborted, paused (cut by an abort pause, made again after the resume), invalid_route.",
		}, []string{"outcome"}),
	}
	reg.MustRegister(m.requests, m.added, m.attempts)
	return m
}

func (m *metrics) request(code int) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(strconv.Itoa(code)).Inc()
}

func (m *metrics) addedLatency(d time.Duration) {
	if m == nil {
		return
	}
	m.added.Observe(max(d, 0).Seconds())
}

func (m *metrics) attempt(outcome string) {
	if m == nil {
		return
	}
	m.attempts.WithLabelValues(outcome).Inc()
}
