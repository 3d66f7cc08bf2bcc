package rollout

import (
	"encoding/json"
	"sync"
	"time"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// record is one rollout's state. Immutable fields are set before the record
// is shared; the rest is guarded by mu.
type record struct {
	id       string
	key      string
	sampleID string
	req      *rolloutv1.InitRolloutRequest
	log      *eventLog
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
	sample      *rolloutv1.RolloutSample
	reward      *float64
	finish      string
	errMsg      string
	errCategory string
	callbackErr string
	seq         int64
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
		Metadata:      r.req.GetMetadata(),
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
	if r.sample != nil {
		out.Workflow = r.sample.GetWorkflow()
		out.Samples = []*rolloutv1.RolloutSample{r.sample}
	}
	return out
}

// callProto converts a proxy record to its wire form.
func callProto(c *llmproxy.Call) *rolloutv1.LLMCall {
	out := &rolloutv1.LLMCall{
		Id:                 c.ID,
		RequestedModel:     c.RequestedModel,
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
