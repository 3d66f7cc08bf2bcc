package rollout

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/host"
	"github.com/osmo-rl/osmo/internal/structjson"
)

// collect asks every sample source the workflow registered for its sample
// and keeps them on rec, in registration order, each with the LLM calls the
// proxy recorded for it. A source that fails (or has no messages) still
// leaves its sample; the errors are returned together.
func (s *Service) collect(rec *record, r *osmo.Rollout) error {
	var errs []error
	var samples []*rolloutv1.RolloutSample
	for _, src := range host.Sources(r) {
		got, err := readSource(src.Source)
		msgs, raw := got.msgs, got.raw
		rec.mu.Lock()
		calls, started := rec.callsOf(src.ID), rec.started
		tools, recorded := rec.tools[src.ID]
		rec.mu.Unlock()
		if err == nil && msgs == nil && raw == nil {
			msgs = recordedConversation(calls)
		}
		if err == nil && len(msgs) == 0 && len(raw) == 0 {
			err = errors.New("no messages: the source returned none and no LLM call was recorded for it")
		}
		d := make(decoded, 0, len(raw)+2*len(calls))
		sample := &rolloutv1.RolloutSample{
			RolloutId: rec.id,
			Id:        src.ID,
			Label:     rec.label,
			Metadata:  rec.metadata,
			Workflow:  rec.workflow,
			LlmCalls:  callProtos(calls, &d),
		}
		sample.Metrics = sampleMetrics(calls, sample.LlmCalls, tools, recorded, started)
		if err == nil {
			var structs []*structpb.Struct
			var cerr error
			if raw != nil {
				structs, cerr = sourceStructs(raw, &d)
			} else {
				structs, cerr = toStructs(msgs)
			}
			if cerr != nil {
				err = fmt.Errorf("messages are not JSON objects: %w", cerr)
			}
			sample.Messages = structs
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("sample %q: %w", src.ID, err))
		}
		switch {
		case len(got.extra) == 0:
			// The request's own, which nothing changes.
			if len(rec.extra.GetFields()) > 0 {
				sample.ExtraFields = rec.extra
			}
		default:
			sample.ExtraFields, _ = toStruct(mergeExtra(rec.extra, got.extra))
		}
		sample.FinishReason = got.finish
		if got.reward != nil {
			sample.AgentReward = proto.Float64(*got.reward)
		}
		samples = append(samples, sample)
	}
	rec.mu.Lock()
	rec.samples = samples
	rec.mu.Unlock()
	return errors.Join(errs...)
}

// sourced is what a sample source says of its sample.
type sourced struct {
	msgs []osmo.Message
	// raw are the messages of a source that holds them as JSON
	// (osmo.SampleJSON), instead of msgs.
	raw    []json.RawMessage
	extra  map[string]any
	finish string
	reward *float64
}

// readSource asks a source for its sample, turning a panic into an error:
// sources are user code.
func readSource(src osmo.SampleSource) (out sourced, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("sample source panicked: %v", p)
		}
	}()
	if js, ok := src.(osmo.SampleJSON); ok {
		out.raw, err = js.SampleMessagesJSON()
	} else {
		out.msgs, err = src.SampleMessages()
	}
	if err != nil {
		return out, err
	}
	if x, ok := src.(osmo.SampleExtras); ok {
		out.extra = x.SampleExtraFields()
	}
	if r, ok := src.(osmo.SampleResult); ok {
		out.finish, out.reward = r.SampleFinishReason(), r.SampleAgentReward()
	}
	return out, nil
}

// callsOf returns the calls recorded for sampleID. Caller holds mu.
func (r *record) callsOf(sampleID string) []*recordedCall {
	var out []*recordedCall
	for _, c := range r.calls {
		if c.SampleID == sampleID {
			out = append(out, c)
		}
	}
	return out
}

// mergeExtra lays a source's extra fields over the request's.
func mergeExtra(base *structpb.Struct, extra map[string]any) map[string]any {
	out := base.AsMap()
	maps.Copy(out, extra)
	return out
}

// recordedConversation is the conversation the proxy saw for a sample: the
// last successful call's request messages and its answer.
func recordedConversation(calls []*recordedCall) []osmo.Message {
	var last *recordedCall
	var req, whole []json.RawMessage
	for _, c := range calls {
		whole = append(whole[:c.shared:c.shared], c.added...)
		if c.Err == "" && len(c.ResponseMessage) > 0 {
			last, req = c, whole
		}
	}
	if last == nil {
		return nil
	}
	msgs := make([]osmo.Message, 0, len(req)+1)
	for _, m := range req {
		var msg osmo.Message
		_ = json.Unmarshal(m, &msg)
		msgs = append(msgs, msg)
	}
	var answer osmo.Message
	if json.Unmarshal(last.ResponseMessage, &answer) == nil && answer != nil {
		msgs = append(msgs, answer)
	}
	return msgs
}

// sampleMetrics sums a sample's calls (protos are their wire forms). Its
// tool calls are those its agent recorded (Rollout.RecordToolCall), or
// else the ones the policy asked for; its latency is the workflow's run
// so far.
func sampleMetrics(calls []*recordedCall, protos []*rolloutv1.LLMCall, tools toolStats, recorded bool, started time.Time) *rolloutv1.RolloutMetrics {
	m := callMetrics(calls, started, time.Now())
	if recorded {
		m.NumToolCalls, m.ToolLatencyMs = int32(tools.n), ms(tools.latency)
		return m
	}
	for i, c := range calls {
		m.NumToolCalls += int32(toolCalls(c.ResponseMessage, protos[i].GetResponseMessage()))
	}
	return m
}

// toolCalls counts the tool calls of a response message, raw and decoded
// (nil if it did not decode): what decoding raw's "tool_calls" (a
// case-insensitive key) as a list gives, read from the decoded message.
func toolCalls(raw json.RawMessage, decoded *structpb.Struct) int {
	if len(raw) == 0 {
		return 0
	}
	var found *structpb.Value
	n := 0
	for k, v := range decoded.GetFields() {
		if strings.EqualFold(k, "tool_calls") {
			found = v
			n++
		}
	}
	if decoded == nil || n > 1 {
		// Not a message protojson reads, or keys that differ by case,
		// where the last in raw wins.
		var resp struct {
			ToolCalls []json.RawMessage `json:"tool_calls"`
		}
		if json.Unmarshal(raw, &resp) != nil {
			return 0
		}
		return len(resp.ToolCalls)
	}
	return len(found.GetListValue().GetValues())
}

// callProto converts a recorded call to its wire form, but for its request
// messages (callProtos).
func callProto(c *recordedCall, d *decoded) *rolloutv1.LLMCall {
	out := &rolloutv1.LLMCall{
		Id:                 c.ID,
		RequestedModel:     c.RequestedModel,
		Api:                c.API,
		Model:              c.Model,
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
		if s, err := d.decode(c.ResponseMessage); err == nil {
			out.ResponseMessage = s
		}
	}
	return out
}

// toStruct converts a Go JSON-shaped object to a Struct. An object of
// JSON's own types (what decoding JSON gives) is converted directly;
// anything else (typed slices, nested structs, float32s) goes through
// JSON, which accepts every shape encoding/json does and gives the same
// Struct for the rest.
func toStruct(m map[string]any) (*structpb.Struct, error) {
	if m != nil {
		if s, ok := directStruct(m); ok {
			return s, nil
		}
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	return structjson.Decode(b)
}

// directStruct converts m when every value in it is JSON's own type and
// converts exactly as through JSON: strings and keys valid UTF-8 (JSON
// would replace what is not), finite numbers (JSON refuses the others),
// ints that a float64 holds as JSON's decimal form would parse.
func directStruct(m map[string]any) (*structpb.Struct, bool) {
	fields := make(map[string]*structpb.Value, len(m))
	for k, v := range m {
		if !utf8.ValidString(k) {
			return nil, false
		}
		pv, ok := directValue(v)
		if !ok {
			return nil, false
		}
		fields[k] = pv
	}
	return &structpb.Struct{Fields: fields}, true
}

func directValue(v any) (*structpb.Value, bool) {
	switch v := v.(type) {
	case nil:
		return structpb.NewNullValue(), true
	case string:
		return structpb.NewStringValue(v), utf8.ValidString(v)
	case bool:
		return structpb.NewBoolValue(v), true
	case float64:
		return structpb.NewNumberValue(v), !math.IsNaN(v) && !math.IsInf(v, 0)
	case int:
		return structpb.NewNumberValue(float64(v)), true
	case int64:
		return structpb.NewNumberValue(float64(v)), true
	case int32:
		return structpb.NewNumberValue(float64(v)), true
	case map[string]any:
		if v == nil {
			return structpb.NewNullValue(), true
		}
		s, ok := directStruct(v)
		return structpb.NewStructValue(s), ok
	case []any:
		if v == nil {
			return structpb.NewNullValue(), true
		}
		list := make([]*structpb.Value, len(v))
		for i, e := range v {
			ev, ok := directValue(e)
			if !ok {
				return nil, false
			}
			list[i] = ev
		}
		return structpb.NewListValue(&structpb.ListValue{Values: list}), true
	}
	return nil, false
}

func toStructs(msgs []map[string]any) ([]*structpb.Struct, error) {
	out := make([]*structpb.Struct, 0, len(msgs))
	for _, m := range msgs {
		s, err := toStruct(m)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// sourceStructs is toStructs of messages a source holds as JSON: each read
// by the Struct parser, without the maps of SampleMessages. One the parser
// refuses (it leaves what is out of the ordinary to protojson, which
// refuses invalid UTF-8 and duplicate keys) is read through a map, as
// SampleMessages would have given it: the same Structs either way
// (TestSourceStructsAreToStructs).
func sourceStructs(raw []json.RawMessage, d *decoded) ([]*structpb.Struct, error) {
	out := make([]*structpb.Struct, 0, len(raw))
	for _, b := range raw {
		s, err := d.decode(b)
		if err != nil {
			var m map[string]any
			if err := json.Unmarshal(b, &m); err != nil {
				return nil, err
			}
			if s, err = toStruct(m); err != nil {
				return nil, err
			}
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
