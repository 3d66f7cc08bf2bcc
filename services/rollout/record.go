package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/host"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// record is one rollout, whatever wire started it. The fields above mu are
// set at admission, before the record is shared; the rest is guarded by mu.
type record struct {
	id       string
	workflow string
	// key makes admission idempotent: G1's idempotency_key, else the id.
	key string
	// wire is the protocol that started the rollout, holding its request.
	wire wire
	in   *host.Input
	// label is the row's ground truth (only the grader sees it).
	label    *string
	metadata json.RawMessage
	// extra is passed through to every sample's extra_fields.
	extra json.RawMessage
	// gradable: the row has what grading needs (the wire's rule).
	gradable bool
	// upstream is where the LLM calls go; token is the bearer the
	// rollout's clients present to the embedded proxy (the trainer's keys
	// never leave the server).
	upstream llmproxy.Route
	token    string
	// budget bounds the workflow (and, when fromAdmission, the time queued
	// too); budgetName says where it came from in messages.
	budget        time.Duration
	budgetName    string
	fromAdmission bool
	gradeBudget   time.Duration
	created       time.Time
	log           *eventLog
	// From admission to enqueue: slot is the slot of a rollout that starts
	// here at once (startsHere); placed says a private queue reserved it a
	// place (shared.admitQueued).
	slot   func()
	placed bool

	// runCtx bounds the queue wait and the workflow; gradeCtx the grading.
	// A cancel ends both; shutdown only runCtx.
	runCtx      context.Context
	runCancel   context.CancelCauseFunc
	gradeCtx    context.Context
	gradeCancel context.CancelCauseFunc
	// span is the rollout's span and bag the baggage carrying its ids; nil
	// and empty when not tracing.
	span trace.Span
	bag  baggage.Baggage

	mu       sync.Mutex
	state    rolloutv1.State
	started  time.Time
	finished time.Time
	calls    []*osmo.LLMCall
	// convs holds each sample's last call's whole request messages (see
	// compact).
	convs     map[string][]json.RawMessage
	tools     map[string]toolStats // by sample id
	samples   []*sample.Sample
	cancelled bool
	// out is the outcome once final says it is known.
	out         outcome.Outcome
	final       bool
	reward      *float64
	callbackErr string
	seq         int64
	// frozen: the record was stored finished and let go of its parts.
	frozen bool
	// versions and stale are set when the run ended (staleness.go).
	versions *policyVersions
	stale    bool
	// work is the queue's message for the rollout, held while this replica
	// runs or concludes it.
	work jetstream.Msg
	// handed: a callback of the rollout went to the outbox.
	handed atomic.Bool
}

// toolStats are the tool calls a sample's agent recorded itself.
type toolStats struct {
	n       int
	latency time.Duration
}

// errCancelled is the cause of a rollout cancelled through CancelRollouts.
var errCancelled = errors.New("cancelled by request")

// initContexts gives the record its run and grade contexts under parent,
// which shutdown cancels.
func (r *record) initContexts(parent context.Context) {
	r.runCtx, r.runCancel = context.WithCancelCause(parent)
	r.gradeCtx, r.gradeCancel = context.WithCancelCause(context.WithoutCancel(parent))
}

// Cancel dispositions of the G3 cancel endpoint.
const (
	dispositionQueued   = "cancelled_queued"
	dispositionRunning  = "cancelled_running"
	dispositionNotFound = "not_found"
)

// cancel cancels the rollout on request and reports what it stopped:
// cancelled_queued, cancelled_running, or not_found when its outcome is
// already final or it was cancelled before.
func (r *record) cancel() string {
	r.mu.Lock()
	st := r.state
	done := r.cancelled || r.final
	if !done {
		r.cancelled = true
	}
	r.mu.Unlock()
	if done {
		return dispositionNotFound
	}
	r.runCancel(errCancelled)
	r.gradeCancel(errCancelled)
	if st == rolloutv1.State_STATE_QUEUED {
		return dispositionQueued
	}
	return dispositionRunning
}

// startRunning moves a queued rollout to running unless it was cancelled;
// it reports whether it did. Cancel reads the state under the same lock, so
// a rollout it reports as cancelled_queued never starts its workflow.
func (r *record) startRunning() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cancelled {
		return false
	}
	r.state = rolloutv1.State_STATE_RUNNING
	r.started = time.Now()
	return true
}

func (r *record) setState(s rolloutv1.State) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.state = s
}

// settle records the rollout's final outcome.
func (r *record) settle(o outcome.Outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.out, r.final, r.state = o, true, o.State
	r.reward = nil
	if o.OK() {
		r.reward = meanReward(r.samples)
	}
}

// meanReward is a rollout's reward: the mean of its kept samples' rewards
// (the grader's, else the agent's own); nil when none has one.
func meanReward(samples []*sample.Sample) *float64 {
	var sum float64
	n := 0
	for _, sm := range samples {
		if sm.RemoveSample {
			continue
		}
		r := sm.Reward
		if r == nil {
			r = sm.AgentReward
		}
		if r != nil {
			sum += *r
			n++
		}
	}
	if n == 0 {
		return nil
	}
	mean := sum / float64(n)
	return &mean
}

func (r *record) addCall(c *osmo.LLMCall) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.frozen { // a late call of an abandoned workflow
		return
	}
	if r.convs == nil {
		r.convs = map[string][]json.RawMessage{}
	}
	r.convs[c.SampleID] = compact(c, r.convs[c.SampleID])
	r.calls = append(r.calls, c)
}

func (r *record) addToolCall(sampleID string, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tools == nil {
		r.tools = map[string]toolStats{}
	}
	ts := r.tools[sampleID]
	ts.n++
	ts.latency += d
	r.tools[sampleID] = ts
}

func (r *record) addCallbackError(kind string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.callbackErr != "" {
		r.callbackErr += "; "
	}
	r.callbackErr += kind + ": " + err.Error()
}

func (r *record) setSeq(seq int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq = seq
}

// snapshot copies the samples for callers that read them without the lock.
// Shallow copies: once collected, only a sample's own fields change.
func (r *record) snapshot() []*sample.Sample {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*sample.Sample, len(r.samples))
	for i, s := range r.samples {
		cp := *s
		out[i] = &cp
	}
	return out
}

// primary is a copy of the rollout's first sample, the one single-sample
// bodies carry; nil when there is none.
func (r *record) primary() *sample.Sample {
	if samples := r.snapshot(); len(samples) > 0 {
		return samples[0]
	}
	return nil
}

// metrics sums what was recorded over the whole rollout. Caller holds mu.
func (r *record) metricsLocked(end time.Time) *osmo.SampleMetrics {
	m := callMetrics(r.calls, r.started, end)
	for _, ts := range r.tools {
		m.NumToolCalls += ts.n
		m.ToolLatencyMS += ms(ts.latency)
	}
	return m
}

// callMetrics sums LLM calls; the latency is the run's so far.
func callMetrics(calls []*osmo.LLMCall, started, end time.Time) *osmo.SampleMetrics {
	m := &osmo.SampleMetrics{NumLLMCalls: len(calls)}
	if !started.IsZero() {
		m.TotalLatencyMS = ms(end.Sub(started))
	}
	for _, c := range calls {
		m.LLMLatencyMS += c.LatencyMS
		m.PromptTokens += c.Usage.PromptTokens
		m.ResponseTokens += c.Usage.CompletionTokens
		ctxTokens := c.Usage.PromptTokens + c.Usage.CompletionTokens
		if c.Usage.TotalTokens > 0 {
			ctxTokens = c.Usage.TotalTokens
		}
		m.MaxContextTokens = max(m.MaxContextTokens, ctxTokens)
	}
	return m
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// rolloutRecord is a rollout as GetRollout and watchers see it and as a
// finished one is stored: the API's Rollout under its JSON names, with
// samples as the JSON they were collected as.
type rolloutRecord struct {
	RolloutID     string              `json:"rollout_id"`
	State         rolloutv1.State     `json:"state"`
	Workflow      string              `json:"workflow,omitempty"`
	Samples       []*sample.Sample    `json:"samples,omitempty"`
	Reward        *float64            `json:"reward,omitempty"`
	FinishReason  string              `json:"finish_reason,omitempty"`
	ErrorMessage  string              `json:"error_message,omitempty"`
	ErrorCategory string              `json:"error_category,omitempty"`
	Metrics       *osmo.SampleMetrics `json:"metrics,omitempty"`
	Metadata      json.RawMessage     `json:"metadata,omitempty"`
	CreatedAt     time.Time           `json:"created_at,omitzero"`
	StartedAt     time.Time           `json:"started_at,omitzero"`
	FinishedAt    time.Time           `json:"finished_at,omitzero"`
	Sequence      int64               `json:"sequence,omitempty"`
	CallbackError string              `json:"callback_error,omitempty"`
	Wire          string              `json:"wire,omitempty"`

	PolicyVersions *policyVersions `json:"policy_versions,omitempty"`
	Stale          bool            `json:"stale,omitempty"`
}

// policyVersions is the span of versions of a rollout's calls.
type policyVersions struct {
	Min int64 `json:"min"`
	Max int64 `json:"max"`
}

// versionSpan is the span of versions of the calls that went upstream
// (nil when none did).
func versionSpan(calls []*osmo.LLMCall) *policyVersions {
	var v *policyVersions
	for _, c := range calls {
		if c.Attempts == 0 {
			continue // answered by the proxy itself
		}
		if v == nil {
			v = &policyVersions{Min: c.PolicyVersion, Max: c.PolicyVersion}
			continue
		}
		v.Min, v.Max = min(v.Min, c.PolicyVersion), max(v.Max, c.PolicyVersion)
	}
	return v
}

// rolloutProto reads a stored record (or one a replica answered) as the
// API's Rollout.
func rolloutProto(b []byte) (*rolloutv1.Rollout, error) {
	out := &rolloutv1.Rollout{}
	return out, sample.FromJSON(b, out)
}

// proto renders the record for GetRollout.
func (r *record) proto() (*rolloutv1.Rollout, error) {
	b, err := json.Marshal(r.render())
	if err != nil {
		return nil, err
	}
	return rolloutProto(b)
}

// render is the record as stored.
func (r *record) render() *rolloutRecord {
	samples := r.snapshot()
	r.mu.Lock()
	defer r.mu.Unlock()
	end := r.finished
	if end.IsZero() {
		end = time.Now()
	}
	out := &rolloutRecord{
		RolloutID:      r.id,
		State:          r.state,
		Workflow:       r.workflow,
		Samples:        samples,
		Reward:         r.reward,
		ErrorMessage:   r.out.Message,
		ErrorCategory:  string(r.out.Category),
		Metrics:        r.metricsLocked(end),
		Stale:          r.stale,
		PolicyVersions: r.versions,
		Metadata:       r.metadata,
		CreatedAt:      r.created,
		StartedAt:      r.started,
		FinishedAt:     r.finished,
		Sequence:       r.seq,
		CallbackError:  r.callbackErr,
		Wire:           r.wire.name(),
	}
	if out.PolicyVersions == nil && !r.frozen {
		// Still running: the calls so far.
		out.PolicyVersions = versionSpan(r.calls)
	}
	if len(samples) > 0 {
		out.FinishReason = samples[0].FinishReason
	}
	return out
}

// freeze lets go of what only running the rollout needed, once its
// finished record is stored.
func (r *record) freeze() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.frozen = true
	r.samples, r.calls, r.convs, r.tools, r.in, r.metadata, r.extra = nil, nil, nil, nil, nil, nil, nil
	r.upstream, r.token = llmproxy.Route{}, ""
	r.wire.forget()
}

// status renders the G3 status body.
func (r *record) status() *rolloutv1.RolloutStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := &rolloutv1.RolloutStatus{RolloutId: r.id, Status: outcome.StatusWord(r.state), Reward: r.reward}
	if r.final {
		out.ErrMessage, out.ErrCategory = errorFields(r.out)
	}
	return out
}
