package rollout

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/host"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// g2Wire is POST /rollout as the Osmosis SDK v0.2 speaks it (G2, with the
// G3 additions): the LLM calls go to {chat_completions_url} under
// controller_api_key, the completion callback follows the run and the
// grader callback the grading. Every body is one a v0.3 controller reads
// too: the grader callback carries v0.2's samples map and v0.3's single
// sample, and only statuses and categories in both vocabularies are sent.
//
// v03 says the request is v0.3's, today's SDK: the G2 body plus
// llm_api_key, the LLM calls' bearer (controller_api_key stays the
// callbacks'), and rollout_id optional because the controller's URLs name
// the rollout. Its callbacks are G2's.
type g2Wire struct {
	req *rolloutv1.StartRolloutRequest
	id  string
	v03 bool
}

// StartRollout implements POST /rollout for G2 and v0.3 controllers. A
// request is v0.3's when it has llm_api_key or leaves rollout_id out. At
// capacity it answers ResourceExhausted (429 with Retry-After); an id the
// server holds is accepted again without starting anything.
func (s *Service) StartRollout(ctx context.Context, req *rolloutv1.StartRolloutRequest) (*rolloutv1.StartRolloutResponse, error) {
	id := req.GetRolloutId()
	if id == "" {
		id = idFromCompletionURL(req.GetCompletionCallbackUrl())
	}
	if err := validateStart(req, id, s.cfg.MaxMetadataBytes, s.cfg.Outbound, s.cfg.Engines == nil); err != nil {
		s.metrics.rejected.WithLabelValues(rejectInvalid).Inc()
		s.reportRejected(ctx, req, id, err)
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.admitWithin)
	defer cancel()
	rec := s.g2Record(req, id, req.LlmApiKey != nil || req.GetRolloutId() == "")
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

// g2Record is the record of a valid POST /rollout request for rollout id,
// spoken as v0.3 or not: what admission writes, and what a restart
// rebuilds from the state log.
func (s *Service) g2Record(req *rolloutv1.StartRolloutRequest, id string, v03 bool) *record {
	rec := s.newRecord(id, id, &g2Wire{req: req, id: id, v03: v03})
	rec.label = labelText(req.GetLabel())
	rec.in = &host.Input{
		RolloutID: id,
		Prompt:    fromStructs(req.GetInitialMessages()),
		Metadata:  metadataMap(req.GetMetadata()),
		Label:     rec.label,
	}
	rec.metadata = structJSON(req.GetMetadata())
	rec.extra = structJSON(req.GetExtraFields())
	// PROTOCOL.md's gate: a row is graded when it has a label or metadata.
	rec.gradable = rec.label != nil || rec.metadata != nil
	rec.upstream = llmproxy.Route{
		BaseURL: strings.TrimRight(req.GetChatCompletionsUrl(), "/"),
		APIKey:  llmKey(req),
		// Agents not written for osmo name models of their own.
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

func (w *g2Wire) name() string {
	if w.v03 {
		return wireV03
	}
	return wireG2
}

func (w *g2Wire) forget() { w.req = nil }

func (w *g2Wire) saved() (proto.Message, proto.Message) { return w.req, nil }

// statusWord is the completion callback's status.
func (*g2Wire) statusWord(o outcome.Outcome) string { return o.Status() }

// ran owes the completion callback: the run's outcome.
func (w *g2Wire) ran(rec *record, run outcome.Outcome) []delivery {
	return []delivery{w.callback("completion_callback", w.req.GetCompletionCallbackUrl(), completionBody(w.id, run), run.Status())}
}

// finished owes the grader callback, when the trainer asked for one.
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

// completionBody reports o.
func completionBody(id string, o outcome.Outcome) g2Completion {
	c := g2Completion{Status: o.Status(), RolloutID: id}
	c.ErrMessage, c.ErrCategory = errorFields(o)
	return c
}

// errorFields are err_message and err_category of a failure (nil for a
// success): the category in the wires' four values, nil for a
// cancellation, which the status says.
func errorFields(o outcome.Outcome) (msg, category *string) {
	if o.OK() {
		return nil, nil
	}
	m := o.Message
	if c := o.Category.Wire(); c != "" {
		return &m, &c
	}
	return &m, nil
}

// g2GraderCallback is the grader callback body of both generations:
// samples (v0.2: every sample by id) and sample (v0.3: one).
type g2GraderCallback struct {
	g2Completion
	Samples map[string]*wireSample `json:"samples"`
	Sample  *wireSample            `json:"sample"`
}

// graderBody reports the final outcome with the samples. Neither
// generation's grader status has "cancelled": a cancelled rollout's is a
// failure saying so. Rewards are sent only for a success, as v0.3 requires
// (a reward anywhere else would be trained on), and sample, v0.3's single
// one, is the first registered, null unless the rollout succeeded.
func graderBody(id string, o outcome.Outcome, samples []*sample.Sample) *g2GraderCallback {
	body := &g2GraderCallback{g2Completion: completionBody(id, o), Samples: map[string]*wireSample{}}
	if o.State == rolloutv1.State_STATE_CANCELLED {
		body.Status = outcome.StatusWord(rolloutv1.State_STATE_FAILED)
	}
	for _, sm := range samples {
		ws := newWireSample(sm, o.OK())
		body.Samples[sm.ID] = ws
		if body.Sample == nil && o.OK() {
			body.Sample = ws
		}
	}
	return body
}

// wireSample is one sample of the grader callback: both generations'
// RolloutSample, and the G3 per-call records (llm_calls).
type wireSample struct {
	ID           string              `json:"id"`
	Messages     []json.RawMessage   `json:"messages"`
	Label        *string             `json:"label"`
	Reward       *float64            `json:"reward"`
	RemoveSample bool                `json:"remove_sample"`
	Metrics      *osmo.SampleMetrics `json:"metrics"`
	ExtraFields  json.RawMessage     `json:"extra_fields"`
	LLMCalls     []wireCall          `json:"llm_calls,omitempty"`
}

// newWireSample renders sm; its reward only when the rollout succeeded and
// the grader kept the sample.
func newWireSample(sm *sample.Sample, ok bool) *wireSample {
	out := &wireSample{
		ID:           sm.ID,
		Messages:     sm.Messages,
		Label:        sm.Label,
		RemoveSample: sm.RemoveSample,
		Metrics:      cmp.Or(sm.Metrics, &osmo.SampleMetrics{}),
		ExtraFields:  sm.ExtraFields,
	}
	if out.Messages == nil {
		out.Messages = []json.RawMessage{}
	}
	if out.ExtraFields == nil { // {}, not null, as the wires have it
		out.ExtraFields = json.RawMessage(`{}`)
	}
	if ok && !sm.RemoveSample {
		// The grader's reward, else the agent's own, as in meanReward.
		out.Reward = cmp.Or(sm.Reward, sm.AgentReward)
	}
	// Each call as recorded, compacted (see compact): neither wire defines
	// llm_calls, and the body stays linear in the turns.
	if len(sm.LLMCalls) > 0 {
		out.LLMCalls = make([]wireCall, len(sm.LLMCalls))
		for i, c := range sm.LLMCalls {
			out.LLMCalls[i] = newWireCall(c)
		}
	}
	return out
}

// wireCall is one of a sample's llm_calls: the recorded call's fields the
// wires have carried, each named here, with the G3 names of its usage and
// model. A field the record gains stays out of the callbacks until it is
// added here: the trainers' controllers read these bodies.
type wireCall struct {
	ID                    string            `json:"id"`
	RequestedModel        string            `json:"requested_model"`
	Model                 string            `json:"model"`
	SharedRequestMessages int               `json:"shared_request_messages"`
	RequestMessages       []json.RawMessage `json:"request_messages"`
	ResponseMessage       json.RawMessage   `json:"response_message"`
	FinishReason          string            `json:"finish_reason"`
	Usage                 osmo.Usage        `json:"usage"`
	LatencyMS             float64           `json:"latency_ms"`
	TimeToFirstTokenMS    float64           `json:"time_to_first_token_ms"`
	Stream                bool              `json:"stream"`
	PromptTokenIDs        []int32           `json:"prompt_token_ids,omitempty"`
	CompletionTokenIDs    []int32           `json:"completion_token_ids,omitempty"`
	Logprobs              []float64         `json:"logprobs,omitempty"`
	StatusCode            int               `json:"status_code"`
	Error                 string            `json:"error"`
	Attempts              int               `json:"attempts"`
	StartedAt             time.Time         `json:"started_at,omitzero"`
	API                   string            `json:"api"`

	PromptTokens     int    `json:"prompt_tokens"`
	CompletionTokens int    `json:"completion_tokens"`
	CachedTokens     int    `json:"cached_tokens"`
	ModelName        string `json:"model_name"`
}

func newWireCall(c *osmo.LLMCall) wireCall {
	return wireCall{
		ID: c.ID, RequestedModel: c.RequestedModel, Model: c.Model,
		SharedRequestMessages: c.SharedRequestMessages, RequestMessages: c.RequestMessages, ResponseMessage: c.ResponseMessage,
		FinishReason: c.FinishReason, Usage: c.Usage, LatencyMS: c.LatencyMS, TimeToFirstTokenMS: c.TimeToFirstTokenMS, Stream: c.Stream,
		PromptTokenIDs: c.PromptTokenIDs, CompletionTokenIDs: c.CompletionTokenIDs, Logprobs: c.Logprobs,
		StatusCode: c.StatusCode, Error: c.Error, Attempts: c.Attempts, StartedAt: c.StartedAt, API: c.API,
		PromptTokens: c.Usage.PromptTokens, CompletionTokens: c.Usage.CompletionTokens, CachedTokens: c.Usage.CachedTokens, ModelName: c.Model,
	}
}
