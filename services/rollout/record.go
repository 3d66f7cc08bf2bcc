package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// record is one rollout's state. Immutable fields are set before the record
// is shared; the rest is guarded by mu.
type record struct {
	id  string
	key string
	// sampleID is the G1 rollout's one sample; empty for G2 rollouts, whose
	// samples are the sources their workflow registers.
	sampleID string
	workflow string
	req      *rolloutv1.InitRolloutRequest  // G1; nil for G2
	g2       *rolloutv1.StartRolloutRequest // G2; nil for G1
	metadata *structpb.Struct
	label    *string
	// token is the bearer the rollout's clients present to the embedded
	// proxy (G2); the trainer's key never leaves the server.
	token string
	log   *eventLog

	// runCtx bounds the queue wait and the agent; gradeCtx the grading.
	// Cancel ends both; shutdown only runCtx (grading finished work
	// survives it).
	runCtx      context.Context
	runCancel   context.CancelCauseFunc
	gradeCtx    context.Context
	gradeCancel context.CancelCauseFunc
	// span is the rollout's span and bag the baggage carrying its ids; nil
	// and empty when not tracing. Both are set before the run starts.
	span trace.Span
	bag  baggage.Baggage

	// ready is closed once init finished (tools computed or failed); initResp
	// and initErr are set before.
	ready    chan struct{}
	initResp *rolloutv1.InitRolloutResponse
	initErr  error

	mu          sync.Mutex
	state       rolloutv1.State
	created     time.Time
	started     time.Time
	finished    time.Time
	calls       []*llmproxy.Call
	toolCalls   int
	toolLatency time.Duration
	samples     []*rolloutv1.RolloutSample
	cancelled   bool
	reward      *float64
	finish      string
	errMsg      string
	errCategory string
	callbackErr string
	seq         int64
}

// errCancelled is the cause of a rollout cancelled through CancelRollouts.
var errCancelled = errors.New("cancelled by request")

// newRecordContexts gives rec its run and grade contexts; parent is the
// service's rollouts context (cancelled at shutdown).
func (r *record) initContexts(parent context.Context) {
	r.runCtx, r.runCancel = context.WithCancelCause(parent)
	r.gradeCtx, r.gradeCancel = context.WithCancelCause(context.WithoutCancel(parent))
}

// cancel cancels the rollout on request and reports what it stopped:
// "cancelled_queued", "cancelled_running" or "not_found" when it had
// already finished (or was cancelled before).
func (r *record) cancel() string {
	r.mu.Lock()
	st := r.state
	done := r.cancelled || !r.finished.IsZero() || r.runCancel == nil ||
		st == rolloutv1.State_STATE_SUCCEEDED || st == rolloutv1.State_STATE_FAILED || st == rolloutv1.State_STATE_CANCELLED
	if !done {
		r.cancelled = true
	}
	r.mu.Unlock()
	if done {
		// Already over (only delivering its callbacks), or cancelled before.
		return dispositionNotFound
	}
	r.runCancel(errCancelled)
	r.gradeCancel(errCancelled)
	if st == rolloutv1.State_STATE_QUEUED {
		return dispositionQueued
	}
	return dispositionRunning
}

// Cancel dispositions of the G3 cancel endpoint.
const (
	dispositionQueued   = "cancelled_queued"
	dispositionRunning  = "cancelled_running"
	dispositionNotFound = "not_found"
)

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

// isQueued reports whether the rollout waits for a slot.
func (r *record) isQueued() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state == rolloutv1.State_STATE_QUEUED
}

func (r *record) setState(s rolloutv1.State) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.state = s
	if s == rolloutv1.State_STATE_RUNNING {
		r.started = time.Now()
	}
}

func (r *record) addCall(c *llmproxy.Call) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, c)
}

func (r *record) addToolCall(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.toolCalls++
	r.toolLatency += d
}

func (r *record) setSeq(seq int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq = seq
}

func (r *record) sequence() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seq
}

func (r *record) finishedAt() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.finished
}

// metrics computes the G1 metrics from what was recorded. Caller holds mu.
func (r *record) metricsLocked(end time.Time) *rolloutv1.RolloutMetrics {
	m := &rolloutv1.RolloutMetrics{
		NumLlmCalls:   int32(len(r.calls)),
		NumToolCalls:  int32(r.toolCalls),
		ToolLatencyMs: ms(r.toolLatency),
	}
	if !r.started.IsZero() {
		m.TotalLatencyMs = ms(end.Sub(r.started))
	}
	for _, c := range r.calls {
		m.LlmLatencyMs += ms(c.Latency)
		m.PromptTokens += int32(c.Usage.PromptTokens)
		m.ResponseTokens += int32(c.Usage.CompletionTokens)
		ctxTokens := int32(c.Usage.PromptTokens + c.Usage.CompletionTokens)
		if c.Usage.TotalTokens > 0 {
			ctxTokens = int32(c.Usage.TotalTokens)
		}
		m.MaxContextTokens = max(m.MaxContextTokens, ctxTokens)
	}
	return m
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// proto renders the record for GetRollout and WatchRollouts.
func (r *record) proto() *rolloutv1.Rollout {
	r.mu.Lock()
	defer r.mu.Unlock()
	end := r.finished
	if end.IsZero() {
		end = time.Now()
	}
	out := &rolloutv1.Rollout{
		RolloutId:     r.id,
		State:         r.state,
		Reward:        r.reward,
		FinishReason:  r.finish,
		ErrorMessage:  r.errMsg,
		ErrorCategory: r.errCategory,
		Metrics:       r.metricsLocked(end),
		Metadata:      r.metadata,
		CreatedAt:     timestamppb.New(r.created),
		Sequence:      r.seq,
		CallbackError: r.callbackErr,
	}
	if !r.started.IsZero() {
		out.StartedAt = timestamppb.New(r.started)
	}
	if !r.finished.IsZero() {
		out.FinishedAt = timestamppb.New(r.finished)
	}
	out.Workflow = r.workflow
	// Copies: the caller (a gRPC encoder) reads them after mu is released,
	// while grading may still set rewards on the originals.
	out.Samples = make([]*rolloutv1.RolloutSample, len(r.samples))
	for i, s := range r.samples {
		out.Samples[i] = proto.Clone(s).(*rolloutv1.RolloutSample)
	}
	return out
}

// callProto converts a proxy record to its wire form.
func callProto(c *llmproxy.Call) *rolloutv1.LLMCall {
	out := &rolloutv1.LLMCall{
		Id:                 c.ID,
		RequestedModel:     c.RequestedModel,
		Api:                c.API,
		Model:              c.Model,
		RequestMessages:    rawStructs(c.RequestMessages),
		FinishReason:       c.FinishReason,
		LatencyMs:          ms(c.Latency),
		TimeToFirstTokenMs: ms(c.TimeToFirstToken),
		Stream:             c.Stream,
		PromptTokenIds:     c.PromptTokenIDs,
		CompletionTokenIds: c.CompletionTokenIDs,
		Logprobs:           c.Logprobs,
		StatusCode:         int32(c.StatusCode),
		Error:              c.Err,
		Attempts:           int32(c.Attempts),
		Usage: &rolloutv1.Usage{
			PromptTokens:     int32(c.Usage.PromptTokens),
			CompletionTokens: int32(c.Usage.CompletionTokens),
			TotalTokens:      int32(c.Usage.TotalTokens),
			CachedTokens:     int32(c.Usage.CachedTokens),
		},
		// The G3 names of the same facts.
		PromptTokens:     int32(c.Usage.PromptTokens),
		CompletionTokens: int32(c.Usage.CompletionTokens),
		CachedTokens:     int32(c.Usage.CachedTokens),
		ModelName:        c.Model,
	}
	if !c.StartedAt.IsZero() {
		out.StartedAt = timestamppb.New(c.StartedAt)
	}
	if len(c.ResponseMessage) > 0 {
		s := &structpb.Struct{}
		if protojson.Unmarshal(c.ResponseMessage, s) == nil {
			out.ResponseMessage = s
		}
	}
	return out
}

// rawStructs decodes a JSON array of objects; elements that are not objects
// are dropped (the proxy already refused requests whose messages are not).
func rawStructs(raw json.RawMessage) []*structpb.Struct {
	if len(raw) == 0 {
		return nil
	}
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return nil
	}
	out := make([]*structpb.Struct, 0, len(items))
	for _, it := range items {
		s := &structpb.Struct{}
		if protojson.Unmarshal(it, s) == nil {
			out = append(out, s)
		}
	}
	return out
}

// toStructs converts Go JSON-shaped messages to Structs through JSON, which
// accepts every shape encoding/json does (typed slices, nested structs).
func toStructs(msgs []map[string]any) ([]*structpb.Struct, error) {
	out := make([]*structpb.Struct, 0, len(msgs))
	for _, m := range msgs {
		b, err := json.Marshal(m)
		if err != nil {
			return nil, err
		}
		s := &structpb.Struct{}
		if err := protojson.Unmarshal(b, s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// fromStructs is the inverse of toStructs.
func fromStructs(in []*structpb.Struct) []map[string]any {
	out := make([]map[string]any, 0, len(in))
	for _, s := range in {
		out = append(out, s.AsMap())
	}
	return out
}

// callsOf returns the calls recorded for sampleID. Caller holds mu.
func (r *record) callsOf(sampleID string) []*llmproxy.Call {
	var out []*llmproxy.Call
	for _, c := range r.calls {
		if c.SampleID == sampleID {
			out = append(out, c)
		}
	}
	return out
}

// fromRaw decodes a JSON array of objects (elements that are not objects
// are dropped).
func fromRaw(raw json.RawMessage) []map[string]any {
	var items []json.RawMessage
	if len(raw) == 0 || json.Unmarshal(raw, &items) != nil {
		return nil
	}
	out := make([]map[string]any, 0, len(items))
	for _, it := range items {
		if m := fromRawObject(it); m != nil {
			out = append(out, m)
		}
	}
	return out
}

// fromRawObject decodes a JSON object, or returns nil.
func fromRawObject(raw json.RawMessage) map[string]any {
	var m map[string]any
	if json.Unmarshal(raw, &m) != nil {
		return nil
	}
	return m
}

// protoMap renders a message as a JSON object with the proto field names,
// the shape of the callbacks.
func protoMap(m proto.Message) map[string]any {
	if m == nil || !m.ProtoReflect().IsValid() {
		return nil
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(m)
	if err != nil {
		return nil
	}
	return fromRawObject(b)
}
