package rollout

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/host"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// g1Wire is the Osmosis remote rollout (G1): POST /v1/rollout/init answers
// with the tools, the LLM calls go to {server_url}/v1/chat/completions with
// the rollout id in the body, and one completion, after grading, goes to
// {server_url}/v1/rollout/completed.
type g1Wire struct {
	req *rolloutv1.InitRolloutRequest
	// resp is the init's answer, which a duplicate init gets too.
	resp *rolloutv1.InitRolloutResponse
}

// InitRollout implements the G1 init, idempotent cluster-wide on the
// rollout id: a duplicate (same idempotency key) gets the first init's
// answer; one under another key conflicts; a failed one is forgotten so a
// retry starts afresh.
func (s *Service) InitRollout(ctx context.Context, req *rolloutv1.InitRolloutRequest) (*rolloutv1.InitRolloutResponse, error) {
	if err := validateInit(req, s.cfg.MaxMetadataBytes, s.cfg.Outbound); err != nil {
		s.metrics.rejected.WithLabelValues(rejectInvalid).Inc()
		return nil, err
	}
	key := req.GetRolloutId()
	if req.IdempotencyKey != nil {
		key = req.GetIdempotencyKey()
	}
	ctx, cancel := context.WithTimeout(ctx, s.admitWithin)
	defer cancel()
	rec, w := s.g1Record(req, key)
	existing, err := s.admit(ctx, rec, phaseAdmitting, false)
	if errors.Is(err, errIDInUse) {
		return nil, status.Errorf(codes.AlreadyExists, "rollout_id %q is already in use under another idempotency key", rec.id)
	}
	if err != nil {
		return nil, err
	}
	if existing != nil {
		if existing.Wire != wireG1 {
			return nil, status.Errorf(codes.AlreadyExists, "rollout_id %q is already in use by a rollout started with POST /rollout", rec.id)
		}
		resp, err := s.awaitInit(ctx, existing)
		if errors.Is(err, errGone) {
			// The first init failed and cleared its lifecycle.
			return s.InitRollout(ctx, req)
		}
		return resp, err
	}

	tools, err := osmo.Hosting().ToolsFor(s.workflow, rec.in.Request)
	var structs []*structpb.Struct
	if err == nil {
		structs = make([]*structpb.Struct, len(tools))
		for i, t := range tools {
			if structs[i], err = sample.Struct(t); err != nil {
				err = errors.New("get_tools returned a tool that is not a JSON object: " + err.Error())
				break
			}
		}
	}
	if err != nil {
		if rerr := s.sh.remove(context.WithoutCancel(ctx), rec.id); rerr != nil {
			s.log.ErrorContext(ctx, "shared state: could not clear a failed init", "rollout_id", rec.id, "error", rerr)
		}
		s.log.ErrorContext(ctx, "init failed", "rollout_id", rec.id, "error", err)
		return nil, status.Error(codes.Internal, err.Error())
	}
	w.resp = &rolloutv1.InitRolloutResponse{RolloutId: rec.id, Tools: structs}
	answer, err := proto.Marshal(w.resp)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encode the init answer: %v", err)
	}
	// Queued with its answer: a duplicate init anywhere gets the same.
	if _, err := s.sh.update(ctx, rec.id, func(lc *lifecycle) error {
		lc.Response, lc.Phase = answer, phaseQueued
		return nil
	}); err != nil {
		_ = s.sh.remove(context.WithoutCancel(ctx), rec.id)
		return nil, unavailable(err)
	}
	if err := s.enqueue(ctx, rec, "init", map[string]any{"num_messages": len(req.GetMessages()), "num_tools": len(tools)}); err != nil {
		return nil, err
	}
	return w.resp, nil
}

// staleInit is how long an init may stay admitting (its tools being
// computed) before a duplicate takes its replica for lost.
const staleInit = 10 * time.Second

// awaitInit is a duplicate init's answer: the first init's, once its tools
// are known (errGone when it failed).
func (s *Service) awaitInit(ctx context.Context, lc *lifecycle) (*rolloutv1.InitRolloutResponse, error) {
	var rev uint64
	for lc.Phase == phaseAdmitting {
		if time.Since(lc.Created) > staleInit && rev != 0 {
			// The replica computing its tools is gone: this one starts
			// afresh.
			err := s.sh.rollouts.Delete(ctx, natsstore.Key(lc.ID), jetstream.LastRevision(rev))
			if err == nil || errors.Is(err, jetstream.ErrKeyNotFound) {
				return nil, errGone
			}
		}
		select {
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		case <-time.After(20 * time.Millisecond):
		}
		var err error
		if lc, rev, err = s.sh.get(ctx, lc.ID); err != nil {
			if errors.Is(err, errGone) {
				return nil, err
			}
			return nil, unavailable(err)
		}
	}
	resp := &rolloutv1.InitRolloutResponse{}
	if err := proto.Unmarshal(lc.Response, resp); err != nil {
		return nil, status.Errorf(codes.Internal, "the saved init answer: %v", err)
	}
	return resp, nil
}

// g1Record is the record of a valid init under idempotency key key.
func (s *Service) g1Record(req *rolloutv1.InitRolloutRequest, key string) (*record, *g1Wire) {
	w := &g1Wire{req: req}
	rec := s.newRecord(req.GetRolloutId(), key, w)
	g1req := sdkRequest(req)
	rec.label = g1Label(req)
	rec.in = &host.Input{RolloutID: rec.id, Prompt: g1req.Messages, Metadata: metadataMap(req.GetMetadata()), Label: rec.label, Request: g1req}
	rec.metadata = structJSON(req.GetMetadata())
	rec.gradable = rec.label != nil
	rec.upstream = llmproxy.Route{
		BaseURL:         strings.TrimRight(req.GetServerUrl(), "/") + "/v1",
		APIKey:          req.GetApiKey(),
		InjectRolloutID: true,
	}
	rec.budget, rec.budgetName = s.cfg.RolloutTimeout, "the rollout timeout"
	rec.gradeBudget = s.cfg.GradeTimeout
	return rec, w
}

// sdkRequest is the init as the SDK's RolloutRequest, budgets left out
// taking their defaults.
func sdkRequest(req *rolloutv1.InitRolloutRequest) *osmo.RolloutRequest {
	return &osmo.RolloutRequest{
		RolloutID:        req.GetRolloutId(),
		ServerURL:        req.GetServerUrl(),
		Messages:         fromStructs(req.GetMessages()),
		CompletionParams: req.GetCompletionParams().AsMap(),
		ToolServerURL:    req.GetToolServerUrl(),
		MaxTurns:         cmp.Or(int(req.GetMaxTurns()), osmo.DefaultMaxTurns),
		MaxTokensTotal:   cmp.Or(int(req.GetMaxTokensTotal()), osmo.DefaultMaxTokensTotal),
		Metadata:         req.GetMetadata().AsMap(),
		IdempotencyKey:   req.GetIdempotencyKey(),
	}
}

func metadataMap(s *structpb.Struct) map[string]any {
	if s == nil {
		return nil
	}
	return s.AsMap()
}

// structJSON is a validated JSON object of a request as JSON; nil for none.
func structJSON(s *structpb.Struct) json.RawMessage {
	b, _ := sample.JSON(s)
	return b
}

// fromStructs is the messages of a request as the workflow reads them.
func fromStructs(in []*structpb.Struct) []osmo.Message {
	out := make([]osmo.Message, len(in))
	for i, s := range in {
		out[i] = s.AsMap()
	}
	return out
}

// g1Label is the G1 ground truth: metadata.ground_truth as text.
func g1Label(req *rolloutv1.InitRolloutRequest) *string {
	v, ok := req.GetMetadata().GetFields()["ground_truth"]
	if !ok {
		return nil
	}
	return labelText(v)
}

// labelText is a label as text: strings as they are, numbers and booleans
// as JSON; null or unset is no label.
func labelText(v *structpb.Value) *string {
	switch k := v.GetKind().(type) {
	case nil, *structpb.Value_NullValue:
		return nil
	case *structpb.Value_StringValue:
		return &k.StringValue
	default:
		text := osmo.SerializeToolResult(v.AsInterface())
		return &text
	}
}

func (*g1Wire) name() string { return wireG1 }

// G1 completion statuses.
const (
	g1Completed = "COMPLETED"
	g1Error     = "ERROR"
)

func (*g1Wire) statusWord(o outcome.Outcome) string {
	if o.OK() {
		return g1Completed
	}
	return g1Error
}

// forget keeps the init's answer: a duplicate init is answered with it.
func (w *g1Wire) forget() { w.req = nil }

func (w *g1Wire) saved() (proto.Message, proto.Message) { return w.req, w.resp }

// ran owes nothing: G1 reports once, after grading.
func (*g1Wire) ran(*record, outcome.Outcome) []delivery { return nil }

func (w *g1Wire) finished(rec *record, run, final outcome.Outcome) []delivery {
	body := &g1Completion{
		RolloutID:     rec.id,
		Status:        w.statusWord(final),
		FinishReason:  "error",
		ErrorMessage:  final.Message,
		FinalMessages: []json.RawMessage{}, // Osmosis sends [] with an ERROR, never null.
	}
	sm := rec.primary()
	if run.OK() && sm != nil {
		// Kept even when grading then failed.
		if sm.Messages != nil {
			body.FinalMessages = sm.Messages
		}
		if x := sm.ExtraFields; len(x) > 0 && string(x) != "{}" {
			body.ExtraFields = x
		}
	}
	rec.mu.Lock()
	if final.OK() {
		body.FinishReason = "stop"
		if sm != nil && sm.FinishReason != "" {
			body.FinishReason = sm.FinishReason
		}
		body.Reward = rec.reward
	}
	body.Metrics = rec.metricsLocked(time.Now())
	rec.mu.Unlock()
	return []delivery{{
		event:  "completion",
		route:  "/v1/rollout/completed",
		url:    strings.TrimRight(w.req.GetServerUrl(), "/") + "/v1/rollout/completed",
		bearer: w.req.GetApiKey(),
		body:   body,
		status: body.Status,
	}}
}

// g1Completion is the body of POST {server_url}/v1/rollout/completed;
// fields the Osmosis server leaves None are omitted.
type g1Completion struct {
	RolloutID     string              `json:"rollout_id"`
	Status        string              `json:"status"`
	FinalMessages []json.RawMessage   `json:"final_messages"`
	FinishReason  string              `json:"finish_reason,omitempty"`
	ErrorMessage  string              `json:"error_message,omitempty"`
	Reward        *float64            `json:"reward,omitempty"`
	ExtraFields   json.RawMessage     `json:"extra_fields,omitempty"`
	Metrics       *osmo.SampleMetrics `json:"metrics,omitempty"`
}
