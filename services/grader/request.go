package grader

import (
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/host"
	"github.com/osmo-rl/osmo/internal/fielderr"
)

// badField is a bad-input error naming its field.
func badField(field, format string, args ...any) error {
	return fielderr.New(field, format, args...)
}

// maxRolloutIDBytes bounds rollout ids: an id is a key of the gradings
// bucket, and so part of a NATS subject, which must fit the server's
// control line (4 KiB by default) once base64-encoded. The rollout service
// allows 256 characters, at most 1 KiB.
const maxRolloutIDBytes = 1024

// validate checks what grading and idempotency rely on: a rollout id, and
// samples with distinct non-empty ids. Ids must be valid UTF-8 because the
// stored gradings (JSON) would otherwise hold a different id than asked.
func validate(req *graderv1.GradeRequest) error {
	if req.GetRolloutId() == "" {
		return badField("rollout_id", "required")
	}
	if !utf8.ValidString(req.GetRolloutId()) {
		return badField("rollout_id", "not valid UTF-8")
	}
	if n := len(req.GetRolloutId()); n > maxRolloutIDBytes {
		return badField("rollout_id", "must be at most %d bytes, got %d", maxRolloutIDBytes, n)
	}
	if len(req.GetSamples()) == 0 {
		return badField("samples", "required: at least one sample")
	}
	seen := make(map[string]int, len(req.GetSamples()))
	for i, s := range req.GetSamples() {
		field := fmt.Sprintf("samples[%d].id", i)
		id := s.GetId()
		if id == "" {
			return badField(field, "required")
		}
		if !utf8.ValidString(id) {
			return badField(field, "not valid UTF-8")
		}
		if j, dup := seen[id]; dup {
			return badField(field, "%q repeats samples[%d].id", id, j)
		}
		seen[id] = i
		if rid := s.GetRolloutId(); rid != "" && rid != req.GetRolloutId() {
			return badField(fmt.Sprintf("samples[%d].rollout_id", i), "%q differs from rollout_id %q", rid, req.GetRolloutId())
		}
	}
	return nil
}

func sampleIDs(req *graderv1.GradeRequest) []string {
	ids := make([]string, len(req.GetSamples()))
	for i, s := range req.GetSamples() {
		ids[i] = s.GetId()
	}
	return ids
}

// graderContext builds what a grader sees for the samples ids of req.
//
// The request's label and metadata are the row's; a sample without its own
// takes them, and a request without a label takes the samples' label when
// they all carry the same one, so graders can rely on gc.Label whichever
// way a caller filled the request in.
func graderContext(req *graderv1.GradeRequest, ids []string) *osmo.GraderContext {
	want := make(map[string]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	label := rowLabel(req)
	var metadata map[string]any
	if req.GetMetadata() != nil {
		metadata = req.GetMetadata().AsMap()
	}
	samples := make([]*osmo.Sample, 0, len(ids))
	for _, rs := range req.GetSamples() {
		if want[rs.GetId()] {
			samples = append(samples, toSample(rs, label, metadata))
		}
	}
	return host.NewGraderContext(req.GetRolloutId(), samples, copyString(label), metadata)
}

// rowLabel is the label of the request's row: its own, or the one all
// its samples share.
func rowLabel(req *graderv1.GradeRequest) *string {
	if req.Label != nil {
		return req.Label
	}
	return commonLabel(req.GetSamples())
}

func commonLabel(samples []*rolloutv1.RolloutSample) *string {
	var label *string
	for _, s := range samples {
		if s.Label == nil {
			return nil
		}
		if label != nil && *label != *s.Label {
			return nil
		}
		label = s.Label
	}
	return label
}

func toSample(rs *rolloutv1.RolloutSample, rowLabel *string, rowMetadata map[string]any) *osmo.Sample {
	s := &osmo.Sample{
		ID:           rs.GetId(),
		Messages:     make([]osmo.Message, 0, len(rs.GetMessages())),
		Label:        copyString(rs.Label),
		FinishReason: rs.GetFinishReason(),
	}
	// A message the sample and its calls share (one Struct: the rollout
	// service decodes each distinct message once) is one map here too.
	var maps messageMaps
	for _, m := range rs.GetMessages() {
		s.Messages = append(s.Messages, maps.of(m))
	}
	if s.Label == nil {
		s.Label = copyString(rowLabel)
	}
	if rs.GetMetadata() != nil {
		s.Metadata = rs.GetMetadata().AsMap()
	} else if rowMetadata != nil {
		s.Metadata = rowMetadata
	}
	if rs.GetExtraFields() != nil {
		s.ExtraFields = rs.GetExtraFields().AsMap()
	}
	if rs.AgentReward != nil {
		r := rs.GetAgentReward()
		s.AgentReward = &r
	}
	if rs.Reward != nil {
		r := rs.GetReward()
		s.Reward = &r
	}
	s.RemoveSample = rs.GetRemoveSample()
	if m := rs.GetMetrics(); m != nil {
		s.Metrics = &osmo.SampleMetrics{
			TotalLatencyMS: m.GetTotalLatencyMs(), LLMLatencyMS: m.GetLlmLatencyMs(), ToolLatencyMS: m.GetToolLatencyMs(),
			NumLLMCalls: int(m.GetNumLlmCalls()), NumToolCalls: int(m.GetNumToolCalls()), PromptTokens: int(m.GetPromptTokens()),
			ResponseTokens: int(m.GetResponseTokens()), MaxContextTokens: int(m.GetMaxContextTokens()),
		}
	}
	// A call's request messages come compacted: the ones it shares with
	// the previous call are counted, not sent again. The grader sees them
	// whole; the shared messages are the same maps in both calls.
	var prev []osmo.Message
	for _, c := range rs.GetLlmCalls() {
		call := osmo.LLMCall{
			ID: c.GetId(), Model: c.GetModel(), FinishReason: c.GetFinishReason(),
			Usage: osmo.Usage{
				PromptTokens: int(c.GetUsage().GetPromptTokens()), CompletionTokens: int(c.GetUsage().GetCompletionTokens()),
				TotalTokens: int(c.GetUsage().GetTotalTokens()),
			},
			PromptTokenIDs: c.GetPromptTokenIds(), CompletionTokenIDs: c.GetCompletionTokenIds(), Logprobs: c.GetLogprobs(),
			LatencyMS: c.GetLatencyMs(), StatusCode: int(c.GetStatusCode()), Error: c.GetError(),
		}
		if k := min(int(c.GetSharedRequestMessages()), len(prev)); k > 0 {
			call.RequestMessages = prev[:k:k]
		}
		for _, m := range c.GetRequestMessages() {
			call.RequestMessages = append(call.RequestMessages, maps.of(m))
		}
		prev = call.RequestMessages
		if c.GetResponseMessage() != nil {
			call.ResponseMessage = maps.of(c.GetResponseMessage())
		}
		s.LLMCalls = append(s.LLMCalls, call)
	}
	return s
}

// messageMaps are a sample's messages made maps so far, by Struct.
type messageMaps []messageMap

type messageMap struct {
	s *structpb.Struct
	m osmo.Message
}

// of is m.AsMap(), or the map already made of m. A sample holds tens of
// messages: a scan of pointers costs less than a map of them.
func (mm *messageMaps) of(m *structpb.Struct) osmo.Message {
	for _, e := range *mm {
		if e.s == m {
			return e.m
		}
	}
	msg := m.AsMap()
	*mm = append(*mm, messageMap{m, msg})
	return msg
}

func copyString(p *string) *string {
	if p == nil {
		return nil
	}
	s := *p
	return &s
}
