package rollout

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/rows"
)

// metrics are the rollout service's Prometheus collectors. Names and units
// follow the Prometheus conventions (seconds, _total counters).
type metrics struct {
	started       prometheus.Counter
	finished      *prometheus.CounterVec
	running       prometheus.Gauge
	duration      *prometheus.HistogramVec
	gradeDuration *prometheus.HistogramVec
	rewards       prometheus.Histogram
	callbacks     *prometheus.CounterVec
	callbackFails prometheus.Counter
	rejected      *prometheus.CounterVec
	llmDuration   *prometheus.HistogramVec
	llmTTFT       prometheus.Histogram
	tokens        *prometheus.CounterVec
	// recovered counts the rollouts a restart found unfinished in the
	// state log, by how they were ended.
	recovered *prometheus.CounterVec
	// stateWrites and stateBytes count the writes to the shared state.
	stateWrites prometheus.Counter
	stateBytes  prometheus.Counter
	// rows, rowDrift and noTokens count finished rollouts' training rows
	// (exact merge) when Config.Rows is on.
	rows     *prometheus.CounterVec
	rowDrift *prometheus.CounterVec
	noTokens prometheus.Counter
}

var latencyBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

func newMetrics(reg prometheus.Registerer) *metrics {
	f := promauto.With(reg) // registers nothing when reg is nil
	m := &metrics{
		started: f.NewCounter(prometheus.CounterOpts{
			Name: "osmo_rollouts_started_total", Help: "Rollouts accepted (duplicate inits are not counted).",
		}),
		finished: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_rollouts_finished_total",
			Help: "Rollouts finished, by status in the words of the wire that started them (G1: COMPLETED, ERROR; G2 and v0.3: success, failure, cancelled) and error category (timeout, validation_error, http_error, agent_error, grader_error, cancelled, stale_policy; empty on success).",
		}, []string{"status", "error_category"}),
		running: f.NewGauge(prometheus.GaugeOpts{
			Name: "osmo_rollouts_running", Help: "Rollouts whose workflow is running now.",
		}),
		duration: f.NewHistogramVec(prometheus.HistogramOpts{
			Name: "osmo_rollout_duration_seconds", Help: "From init to the completion being delivered, by status.",
			Buckets: latencyBuckets,
		}, []string{"status"}),
		gradeDuration: f.NewHistogramVec(prometheus.HistogramOpts{
			Name: "osmo_rollout_grade_duration_seconds", Help: "Time a finished rollout waited for the grader (resends included), by outcome.",
			Buckets: latencyBuckets,
		}, []string{"outcome"}),
		rewards: f.NewHistogram(prometheus.HistogramOpts{
			Name: "osmo_rollout_reward", Help: "Rewards delivered to the trainer.",
			Buckets: []float64{-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1},
		}),
		callbacks: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_callback_attempts_total", Help: "Completion and grader callback attempts, by outcome (ok, retry, failed).",
		}, []string{"outcome"}),
		callbackFails: f.NewCounter(prometheus.CounterOpts{
			Name: "osmo_callback_failures_total", Help: "Callbacks that could not be delivered after every retry.",
		}),
		rejected: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_rollouts_rejected_total", Help: "Rollout starts refused, by reason: invalid (the request failed validation), capacity (POST /rollout answered 429 at capacity).",
		}, []string{"reason"}),
		llmDuration: f.NewHistogramVec(prometheus.HistogramOpts{
			Name: "osmo_llm_call_duration_seconds", Help: "LLM calls through the proxy, by HTTP status answered.",
			Buckets: latencyBuckets,
		}, []string{"code"}),
		llmTTFT: f.NewHistogram(prometheus.HistogramOpts{
			Name: "osmo_llm_time_to_first_token_seconds", Help: "Streaming LLM calls: time to the first content chunk.",
			Buckets: latencyBuckets,
		}),
		tokens: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llm_tokens_total", Help: "Tokens reported by the policy, by direction (input, output).",
		}, []string{"direction"}),
		recovered: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_rollouts_recovered_total",
			Help: "Rollouts of a lost replica (or of this process before a restart) concluded by this one, by how: redelivered (their final result was owed and is delivered again), interrupted (they were running or grading: a failure saying so is delivered).",
		}, []string{"how"}),
		stateWrites: f.NewCounter(prometheus.CounterOpts{
			Name: "osmo_state_writes_total",
			Help: "Writes this replica made to the shared state (lifecycle creates and updates, queue and outbox messages, finished records).",
		}),
		stateBytes: f.NewCounter(prometheus.CounterOpts{
			Name: "osmo_state_write_bytes_total",
			Help: "Bytes of the values this replica wrote to the shared state.",
		}),
		rows: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_rows_total",
			Help: "Training rows of finished rollouts, merged exactly, by merge: exact (a sample's first row), forked (started where a call's prompt did not extend the row, or after a call without usable tokens).",
		}, []string{"merge"}),
		rowDrift: f.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_row_drift_total",
			Help: "Points where a call's prompt parted from the previous call's prompt and completion, by class (reasoning_dropped, tool_call_reserialized, whitespace, other).",
		}, []string{"class"}),
		noTokens: f.NewCounter(prometheus.CounterOpts{
			Name: "osmo_samples_without_tokens_total",
			Help: "Samples of finished rollouts that made LLM calls but yield no training row: no call has usable token ids.",
		}),
	}
	for _, merge := range []string{rows.MergeExact, rows.MergeForked} {
		m.rows.WithLabelValues(merge)
	}
	for _, class := range []string{rows.DriftReasoningDropped, rows.DriftToolCallReserialized, rows.DriftWhitespace, rows.DriftOther} {
		m.rowDrift.WithLabelValues(class)
	}
	for _, how := range []string{recoveredRedelivered, recoveredInterrupted} {
		m.recovered.WithLabelValues(how)
	}
	// Both reasons show from the start, at zero, for alerts on their rate.
	for _, reason := range []string{rejectInvalid, rejectCapacity} {
		m.rejected.WithLabelValues(reason)
	}
	return m
}

// watchShared reports the shared queue's depth and the finished records
// the shared state holds, read when scraped.
func (m *metrics) watchShared(reg prometheus.Registerer, sh *shared) {
	if reg == nil {
		return
	}
	// records reads a figure of the records bucket when scraped.
	records := func(of func(jetstream.KeyValueStatus) uint64) func() float64 {
		return func() float64 {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			st, err := sh.records.Status(ctx)
			if err != nil {
				return 0
			}
			return float64(of(st))
		}
	}
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "osmo_rollouts_queued", Help: "Rollouts accepted and waiting in the shared queue for a replica's slot (all replicas together).",
		}, func() float64 {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			n, _ := sh.queued(ctx)
			return float64(n)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "osmo_rollout_records", Help: "Finished rollout records held in the shared state (for lookups and watchers).",
		}, records(jetstream.KeyValueStatus.Values)),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "osmo_rollout_records_bytes", Help: "Bytes the finished rollout records hold in the shared state, bounded by --record-max-bytes.",
		}, records(jetstream.KeyValueStatus.Bytes)),
	)
}

// How the rollouts of osmo_rollouts_recovered_total were ended.
const (
	recoveredRedelivered = "redelivered"
	recoveredInterrupted = "interrupted"
)

// Reasons of osmo_rollouts_rejected_total.
const (
	rejectInvalid  = "invalid"
	rejectCapacity = "capacity"
)

func (m *metrics) llmCall(c *osmo.LLMCall) {
	m.llmDuration.WithLabelValues(strconv.Itoa(c.StatusCode)).Observe(c.LatencyMS / 1000)
	if c.Stream && c.TimeToFirstTokenMS > 0 {
		m.llmTTFT.Observe(c.TimeToFirstTokenMS / 1000)
	}
	m.tokens.WithLabelValues("input").Add(float64(c.Usage.PromptTokens))
	m.tokens.WithLabelValues("output").Add(float64(c.Usage.CompletionTokens))
}
