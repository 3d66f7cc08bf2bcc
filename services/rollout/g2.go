package rollout

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/host"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// g2Wire is POST /rollout as the Osmosis SDK v0.2 speaks it (G2, seeds
// 000-003, with the G3 additions): the LLM calls go to
// {chat_completions_url}/chat/completions under controller_api_key, the
// completion callback follows the run and the grader callback the grading.
//
// Nothing in a request says whether a v0.2 or a v0.3 controller sent it,
// so every body is one both read: the grader callback carries the v0.2
// samples map and v0.3's single sample, and only statuses and categories
// in both vocabularies are sent. v0.3's additions to admission are in
// v03.go.
type g2Wire struct {
	req    *rolloutv1.StartRolloutRequest
	id     string
	policy callbackPolicy
}

// StartRollout implements POST /rollout for G2 and v0.3 controllers. A
// request is v0.3's when it has llm_api_key or leaves rollout_id out (G2
// requires it); the rest is served the same way. At capacity it answers
// ResourceExhausted (429 with Retry-After); an id the server holds is
// accepted again without starting anything (a trainer retrying a POST
// whose answer it lost).
func (s *Service) StartRollout(ctx context.Context, req *rolloutv1.StartRolloutRequest) (*rolloutv1.StartRolloutResponse, error) {
	id := req.GetRolloutId()
	if id == "" {
		id = idFromCompletionURL(req.GetCompletionCallbackUrl())
	}
	if err := validateStart(req, id, s.cfg.MaxMetadataBytes, s.cfg.Outbound); err != nil {
		s.metrics.rejected.WithLabelValues(rejectInvalid).Inc()
		s.reportRejected(ctx, req, id, err)
		return nil, err
	}
	ctx, cancel := s.admission(ctx)
	defer cancel()
	rec := s.g2Record(req, id)
	existing, err := s.admit(ctx, rec, phaseQueued, true)
	if existing != nil && (err == nil || errors.Is(err, errIDInUse)) {
		s.log.InfoContext(ctx, "duplicate start ignored", "rollout_id", id)
		return &rolloutv1.StartRolloutResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	err = s.enqueue(ctx, rec, "start_request", map[string]any{
		"num_messages": len(req.GetInitialMessages()), "has_label": rec.label != nil,
		"has_metadata": req.Metadata != nil, "grader_callback": req.GraderCallbackUrl != nil,
	})
	if err != nil {
		return nil, err
	}
	return &rolloutv1.StartRolloutResponse{}, nil
}

// g2Record is the record of a valid POST /rollout request for rollout id:
// what admission enters, and what a restart rebuilds from the state log.
func (s *Service) g2Record(req *rolloutv1.StartRolloutRequest, id string) *record {
	g2 := &g2Wire{req: req, id: id, policy: s.g2Policy}
	var w wire = g2
	if req.LlmApiKey != nil || req.GetRolloutId() == "" {
		w = &v03Wire{g2}
	}
	rec := s.newRecord(id, id, w)
	rec.label = labelText(req.GetLabel())
	rec.in = &host.Input{
		RolloutID: id,
		Prompt:    fromStructs(req.GetInitialMessages()),
		Metadata:  metadataMap(req.GetMetadata()),
		Label:     rec.label,
	}
	rec.metadata = req.GetMetadata()
	rec.extra = req.GetExtraFields()
	// PROTOCOL.md's gate: a row is graded when it has a label or metadata.
	rec.gradable = rec.label != nil || rec.metadata != nil
	rec.upstream = llmproxy.Route{
		BaseURL: strings.TrimRight(req.GetChatCompletionsUrl(), "/"),
		APIKey:  llmKey(req),
		// Agents not written for osmo name models of their own; every call
		// must still reach the policy.
		PinModel: true,
	}
	rec.budget, rec.budgetName, rec.fromAdmission = s.cfg.RolloutTimeout, "agent_timeout_sec", true
	if req.AgentTimeoutSec != nil {
		rec.budget = seconds(req.GetAgentTimeoutSec())
	}
	rec.gradeBudget = s.cfg.GradeTimeout
	if req.GraderTimeoutSec != nil {
		rec.gradeBudget = seconds(req.GetGraderTimeoutSec())
	}
	return rec
}

func seconds(v float64) time.Duration { return time.Duration(v * float64(time.Second)) }

func (*g2Wire) name() string { return wireG2 }

func (w *g2Wire) retry() callbackPolicy { return w.policy }

func (w *g2Wire) forget() { w.req = nil }

func (w *g2Wire) saved() (proto.Message, proto.Message) { return w.req, nil }

// statusWord is the completion callback's status: success, failure or
// cancelled (the trainer asked for it: only a v0.3 controller cancels).
func (*g2Wire) statusWord(o outcome.Outcome) string { return o.Status() }

// ran owes the completion callback: the run's outcome.
func (w *g2Wire) ran(rec *record, run outcome.Outcome) []delivery {
	return []delivery{w.callback("completion_callback", w.req.GetCompletionCallbackUrl(), completionBody(w.id, run), run.Status())}
}

// finished owes the grader callback, when the trainer asked for one: the
// samples with their rewards, or the failure.
func (w *g2Wire) finished(rec *record, _, final outcome.Outcome) []delivery {
	if w.req.GraderCallbackUrl == nil {
		return nil
	}
	body := graderBody(w.id, final, rec.snapshot())
	return []delivery{w.callback("grader_callback", w.req.GetGraderCallbackUrl(), body, body.Status)}
}

func (w *g2Wire) callback(event, url string, body any, status string) delivery {
	return delivery{
		event:  event,
		route:  "callback",
		url:    url,
		bearer: w.req.GetControllerApiKey(),
		body:   body,
		status: status,
		policy: w.policy,
	}
}

// g2Completion is the completion callback body, and the head of the grader
// callback's.
type g2Completion struct {
	Status      string  `json:"status"`
	RolloutID   string  `json:"rollout_id"`
	ErrMessage  *string `json:"err_message"`
	ErrCategory *string `json:"err_category"`
}

// completionBody reports o: err_category in the wires' four values, null
// for a cancellation, which the status says.
func completionBody(id string, o outcome.Outcome) g2Completion {
	c := g2Completion{Status: o.Status(), RolloutID: id}
	if !o.OK() {
		msg := o.Message
		c.ErrMessage = &msg
		if cat := o.Category.Wire(); cat != "" {
			c.ErrCategory = &cat
		}
	}
	return c
}

// g2GraderCallback is the grader callback body of both generations:
// samples (v0.2: every sample by id) and sample (v0.3: one).
type g2GraderCallback struct {
	g2Completion
	Samples map[string]*wireSample `json:"samples"`
	Sample  *wireSample            `json:"sample"`
}

// graderBody reports the final outcome with the samples. Its status is
// success or failure: neither generation's grader status has
// "cancelled", so a cancelled rollout's grader callback is a failure
// saying so. Rewards are sent only for a success, as v0.3 requires (a
// reward anywhere else would be trained on), and sample, v0.3's single
// one, is the first the workflow registered, null unless the rollout
// succeeded. A rollout with several samples thus reaches a v0.3
// controller as its first; the samples map carries them all.
func graderBody(id string, o outcome.Outcome, samples []*rolloutv1.RolloutSample) *g2GraderCallback {
	body := &g2GraderCallback{g2Completion: completionBody(id, o), Samples: map[string]*wireSample{}}
	if o.State == rolloutv1.State_STATE_CANCELLED {
		body.Status = outcome.StatusWord(rolloutv1.State_STATE_FAILED)
	}
	for _, sm := range samples {
		ws := newWireSample(sm, o.OK())
		body.Samples[sm.GetId()] = ws
		if body.Sample == nil && o.OK() {
			body.Sample = ws
		}
	}
	return body
}

// wireSample is one sample of the grader callback: the fields of both
// generations' RolloutSample, and llm_calls, the per-call records (token
// ids, logprobs, usage) of the G3 wire. Its parts are the sample's own
// messages, encoded by the one marshal of the callback body.
type wireSample struct {
	ID           string         `json:"id"`
	Messages     []jsonStruct   `json:"messages"`
	Label        *string        `json:"label"`
	Reward       *float64       `json:"reward"`
	RemoveSample bool           `json:"remove_sample"`
	Metrics      *wireMetrics   `json:"metrics"`
	ExtraFields  jsonStruct     `json:"extra_fields"`
	LLMCalls     []*wireLLMCall `json:"llm_calls,omitempty"`
}

// newWireSample renders sm; its reward only when the rollout succeeded and
// the grader kept the sample.
func newWireSample(sm *rolloutv1.RolloutSample, ok bool) *wireSample {
	out := &wireSample{
		ID:           sm.GetId(),
		Messages:     jsonStructs(sm.GetMessages()),
		Label:        sm.Label,
		RemoveSample: sm.GetRemoveSample(),
		Metrics:      newWireMetrics(sm.GetMetrics()),
		// {} rather than null when unset, as the wires have it.
		ExtraFields: jsonStruct{cmp.Or(sm.GetExtraFields(), &structpb.Struct{})},
	}
	if ok && !sm.GetRemoveSample() {
		// The grader's reward, else the agent's own (a workflow that grades
		// itself, served without an osmo grader), as meanReward makes the
		// rollout's.
		out.Reward = cmp.Or(sm.Reward, sm.AgentReward)
	}
	// Each call as stored: its request messages after those it shares
	// with the sample's previous call, which shared_request_messages
	// counts. Neither wire defines llm_calls, so none needs the history
	// copied into every call, and the body stays linear in the turns.
	if calls := sm.GetLlmCalls(); len(calls) > 0 {
		out.LLMCalls = make([]*wireLLMCall, len(calls))
		for i, c := range calls {
			out.LLMCalls[i] = wireCall(c)
		}
	}
	return out
}

// wireLLMCall is one record of a sample's llm_calls: the LLMCall with its
// proto field names, which include the G3 names (prompt_tokens,
// completion_tokens, cached_tokens, model_name) beside usage and model.
// Every field is present, as protojson with EmitUnpopulated renders it,
// except token ids and logprobs the upstream did not return: those are
// left out rather than sent as empty arrays, which would read as "no
// tokens".
type wireLLMCall struct {
	ID              string       `json:"id"`
	RequestedModel  string       `json:"requested_model"`
	Model           string       `json:"model"`
	RequestMessages []jsonStruct `json:"request_messages"`
	// SharedRequestMessages counts the leading request messages this call
	// shares with the sample's previous call's whole request, which
	// request_messages leaves out: call i's whole request is the first N
	// messages of call i-1's whole request, then its own request_messages.
	SharedRequestMessages int32           `json:"shared_request_messages"`
	ResponseMessage       jsonStruct      `json:"response_message"`
	FinishReason          string          `json:"finish_reason"`
	Usage                 *wireUsage      `json:"usage"`
	LatencyMS             jsonFloat       `json:"latency_ms"`
	TimeToFirstTokenMS    jsonFloat       `json:"time_to_first_token_ms"`
	Stream                bool            `json:"stream"`
	PromptTokenIDs        []int32         `json:"prompt_token_ids,omitempty"`
	CompletionTokenIDs    []int32         `json:"completion_token_ids,omitempty"`
	Logprobs              jsonFloats      `json:"logprobs,omitempty"`
	StatusCode            int32           `json:"status_code"`
	Error                 string          `json:"error"`
	Attempts              int32           `json:"attempts"`
	StartedAt             json.RawMessage `json:"started_at"`
	API                   string          `json:"api"`
	PromptTokens          int32           `json:"prompt_tokens"`
	CompletionTokens      int32           `json:"completion_tokens"`
	CachedTokens          int32           `json:"cached_tokens"`
	ModelName             string          `json:"model_name"`
}

// wireMetrics is a RolloutMetrics as its proto JSON form with every field
// and the proto names has it, keys in encoding/json's order for a map.
type wireMetrics struct {
	LlmLatencyMs     jsonFloat `json:"llm_latency_ms"`
	MaxContextTokens int32     `json:"max_context_tokens"`
	NumLlmCalls      int32     `json:"num_llm_calls"`
	NumToolCalls     int32     `json:"num_tool_calls"`
	PromptTokens     int32     `json:"prompt_tokens"`
	ResponseTokens   int32     `json:"response_tokens"`
	ToolLatencyMs    jsonFloat `json:"tool_latency_ms"`
	TotalLatencyMs   jsonFloat `json:"total_latency_ms"`
}

// newWireMetrics renders m; a nil m as zeros, as protojson renders it.
func newWireMetrics(m *rolloutv1.RolloutMetrics) *wireMetrics {
	return &wireMetrics{
		LlmLatencyMs: jsonFloat(m.GetLlmLatencyMs()), MaxContextTokens: m.GetMaxContextTokens(),
		NumLlmCalls: m.GetNumLlmCalls(), NumToolCalls: m.GetNumToolCalls(), PromptTokens: m.GetPromptTokens(),
		ResponseTokens: m.GetResponseTokens(), ToolLatencyMs: jsonFloat(m.GetToolLatencyMs()),
		TotalLatencyMs: jsonFloat(m.GetTotalLatencyMs()),
	}
}

type wireUsage struct {
	PromptTokens     int32 `json:"prompt_tokens"`
	CompletionTokens int32 `json:"completion_tokens"`
	TotalTokens      int32 `json:"total_tokens"`
	CachedTokens     int32 `json:"cached_tokens"`
}

// wireCall renders c, as stored, for the callback body.
func wireCall(c *rolloutv1.LLMCall) *wireLLMCall {
	w := &wireLLMCall{
		ID: c.GetId(), RequestedModel: c.GetRequestedModel(), Model: c.GetModel(),
		RequestMessages: jsonStructs(c.GetRequestMessages()), SharedRequestMessages: c.GetSharedRequestMessages(),
		ResponseMessage: jsonStruct{c.GetResponseMessage()},
		FinishReason:    c.GetFinishReason(),
		LatencyMS:       jsonFloat(c.GetLatencyMs()), TimeToFirstTokenMS: jsonFloat(c.GetTimeToFirstTokenMs()),
		Stream:         c.GetStream(),
		PromptTokenIDs: c.GetPromptTokenIds(), CompletionTokenIDs: c.GetCompletionTokenIds(),
		StatusCode: c.GetStatusCode(), Error: c.GetError(), Attempts: c.GetAttempts(),
		StartedAt: json.RawMessage("null"), API: c.GetApi(),
		PromptTokens: c.GetPromptTokens(), CompletionTokens: c.GetCompletionTokens(), CachedTokens: c.GetCachedTokens(),
		ModelName: c.GetModelName(),
	}
	if u := c.GetUsage(); u != nil {
		w.Usage = &wireUsage{PromptTokens: u.GetPromptTokens(), CompletionTokens: u.GetCompletionTokens(),
			TotalTokens: u.GetTotalTokens(), CachedTokens: u.GetCachedTokens()}
	}
	w.Logprobs = c.GetLogprobs()
	if t := c.GetStartedAt(); t.IsValid() {
		w.StartedAt = appendTimestamp(nil, t)
	}
	return w
}

// jsonFloat is a double as proto JSON has it: a number, or "NaN",
// "Infinity" and "-Infinity" as strings (which plain JSON cannot hold).
type jsonFloat float64

func (f jsonFloat) MarshalJSON() ([]byte, error) { return f.append(nil), nil }

// append writes f: a finite number as encoding/json writes a float64.
func (f jsonFloat) append(b []byte) []byte {
	switch v := float64(f); {
	case math.IsNaN(v):
		return append(b, `"NaN"`...)
	case math.IsInf(v, 1):
		return append(b, `"Infinity"`...)
	case math.IsInf(v, -1):
		return append(b, `"-Infinity"`...)
	default:
		return appendNumber(b, v)
	}
}

// jsonFloats is a list of doubles as proto JSON has it (see jsonFloat).
type jsonFloats []float64

func (fs jsonFloats) MarshalJSON() ([]byte, error) { return fs.append(nil), nil }

func (fs jsonFloats) append(b []byte) []byte {
	if fs == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i, f := range fs {
		if i > 0 {
			b = append(b, ',')
		}
		b = jsonFloat(f).append(b)
	}
	return append(b, ']')
}

// appendTimestamp appends the proto JSON form of a valid timestamp: RFC
// 3339, in UTC, with 0, 3, 6 or 9 fractional digits, quoted.
func appendTimestamp(b []byte, ts *timestamppb.Timestamp) []byte {
	b = append(b, '"')
	b = ts.AsTime().UTC().AppendFormat(b, "2006-01-02T15:04:05")
	if n := ts.GetNanos(); n != 0 {
		digits := 9
		for digits > 3 && n%1000 == 0 {
			n /= 1000
			digits -= 3
		}
		b = append(b, '.')
		frac := strconv.AppendInt(nil, int64(n), 10)
		for range digits - len(frac) {
			b = append(b, '0')
		}
		b = append(b, frac...)
	}
	return append(b, 'Z', '"')
}
