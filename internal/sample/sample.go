// Package sample is a rollout's sample as the rollout and grader services
// keep, store and send it: the conversation, metadata and extra fields as
// the JSON the agent and the trainer sent, decoded only where a field is
// read (a grader, the report), and the LLM calls the proxy recorded.
package sample

import (
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
)

// Sample is one conversation produced by a rollout: the unit a grader
// rewards and a trainer trains on. Its JSON names are those of the API's
// RolloutSample, so that its encoding reads as one (ToProto).
type Sample struct {
	RolloutID string `json:"rollout_id"`
	ID        string `json:"id"`
	// Messages are the conversation as the agent framework shaped it, each
	// a JSON object.
	Messages []json.RawMessage `json:"messages"`
	// Label is the row's ground truth (only graders see it); Metadata the
	// row's metadata column, a JSON object.
	Label    *string         `json:"label,omitempty"`
	Metadata json.RawMessage `json:"metadata,omitempty"`
	// Reward is the grader's; RemoveSample drops the sample from training.
	Reward       *float64            `json:"reward,omitempty"`
	RemoveSample bool                `json:"remove_sample,omitempty"`
	Metrics      *osmo.SampleMetrics `json:"metrics,omitempty"`
	// ExtraFields is a JSON object passed through to the callbacks.
	ExtraFields json.RawMessage `json:"extra_fields,omitempty"`
	// LLMCalls are the sample's calls through the proxy, in order; each
	// counts the request messages it shares with the one before.
	LLMCalls []*osmo.LLMCall `json:"llm_calls,omitempty"`
	// AgentReward is the reward the workflow itself proposed, if any.
	AgentReward  *float64 `json:"agent_reward,omitempty"`
	FinishReason string   `json:"finish_reason,omitempty"`
	Workflow     string   `json:"workflow,omitempty"`
}

// ToProto fills m, a message of the public API, from v, a Go value whose
// JSON names are m's (a Sample, a rollout's record). The API shows
// messages, metadata and extra fields as JSON objects, which in protobuf
// is google.protobuf.Struct: they are converted here, at the API's edge,
// by protojson, and everywhere else travel as the JSON they arrived as.
func ToProto(v any, m proto.Message) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return FromJSON(b, m)
}

// FromJSON fills m from JSON with m's field names (as ToProto encodes, or
// as stored).
func FromJSON(b []byte, m proto.Message) error {
	return protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, m)
}

// FromProto fills v, a Go value whose JSON names are m's, from m: the
// inverse of ToProto, for what arrives through the API as protobuf.
func FromProto(m proto.Message, v any) error {
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// Grader decodes s for a grader. The row's label and metadata stand in for
// a sample's own when it has none.
func (s *Sample) Grader(rowLabel *string, rowMetadata map[string]any) (*osmo.Sample, error) {
	out := &osmo.Sample{
		ID:           s.ID,
		Messages:     make([]osmo.Message, len(s.Messages)),
		Label:        s.Label,
		Reward:       s.Reward,
		RemoveSample: s.RemoveSample,
		Metrics:      s.Metrics,
		LLMCalls:     s.LLMCalls,
		AgentReward:  s.AgentReward,
		FinishReason: s.FinishReason,
	}
	for i, m := range s.Messages {
		if err := json.Unmarshal(m, &out.Messages[i]); err != nil {
			return nil, fmt.Errorf("messages[%d]: %w", i, err)
		}
	}
	if out.Label == nil {
		out.Label = rowLabel
	}
	out.Metadata = rowMetadata
	if len(s.Metadata) > 0 {
		if err := json.Unmarshal(s.Metadata, &out.Metadata); err != nil {
			return nil, fmt.Errorf("metadata: %w", err)
		}
	}
	if len(s.ExtraFields) > 0 {
		if err := json.Unmarshal(s.ExtraFields, &out.ExtraFields); err != nil {
			return nil, fmt.Errorf("extra_fields: %w", err)
		}
	}
	return out, nil
}

// Struct is v, a Go value that encodes as a JSON object, as the API's
// google.protobuf.Struct.
func Struct(v any) (*structpb.Struct, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	out := &structpb.Struct{}
	return out, protojson.Unmarshal(b, out)
}

// JSON is a Struct that came through the API as the JSON object it holds;
// nil for none.
func JSON(s *structpb.Struct) (json.RawMessage, error) {
	if s == nil {
		return nil, nil
	}
	return protojson.Marshal(s)
}
