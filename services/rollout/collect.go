package rollout

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/sample"
)

// collect asks every sample source the workflow registered for its sample
// and keeps them on rec, in order, each with its recorded LLM calls. A
// source that fails still leaves its sample; the errors are returned
// together.
func (s *Service) collect(rec *record, r *osmo.Rollout) error {
	var errs []error
	var samples []*sample.Sample
	for id, src := range osmo.Hosting().Sources(r) {
		got, err := readSource(src)
		rec.mu.Lock()
		calls, started := rec.callsOf(id), rec.started
		tools, recorded := rec.tools[id]
		rec.mu.Unlock()
		msgs := got.msgs
		if err == nil && msgs == nil {
			msgs = recordedConversation(calls)
		}
		if err == nil && len(msgs) == 0 {
			err = errors.New("no messages: the source returned none and no LLM call was recorded for it")
		}
		if err == nil {
			err = checkObjects(msgs)
		}
		sm := &sample.Sample{
			RolloutID: rec.id,
			ID:        id,
			Label:     rec.label,
			Metadata:  rec.metadata,
			Workflow:  rec.workflow,
			LLMCalls:  calls,
			Metrics:   sampleMetrics(calls, tools, recorded, started),
		}
		if err == nil {
			sm.Messages = msgs
		} else {
			errs = append(errs, fmt.Errorf("sample %q: %w", id, err))
		}
		sm.ExtraFields = rec.extra
		if len(got.extra) > 0 {
			if sm.ExtraFields, err = mergeExtra(rec.extra, got.extra); err != nil {
				errs = append(errs, fmt.Errorf("sample %q: extra fields: %w", id, err))
			}
		}
		sm.FinishReason = got.finish
		if r := got.reward; r != nil && !math.IsNaN(*r) && !math.IsInf(*r, 0) { // JSON has no others
			sm.AgentReward = r
		}
		samples = append(samples, sm)
	}
	rec.mu.Lock()
	rec.samples = samples
	rec.mu.Unlock()
	return errors.Join(errs...)
}

// checkObjects checks that every message is a JSON object.
func checkObjects(msgs []json.RawMessage) error {
	for i, m := range msgs {
		if t := bytes.TrimLeft(m, " \t\r\n"); len(t) == 0 || t[0] != '{' || !json.Valid(m) {
			return fmt.Errorf("messages are not JSON objects: message %d is %.40s", i, m)
		}
	}
	return nil
}

// sourced is what a sample source says of its sample.
type sourced struct {
	msgs   []json.RawMessage
	extra  map[string]any
	finish string
	reward *float64
}

// readSource asks a source (user code) for its sample, a panic made an
// error.
func readSource(src osmo.SampleSource) (out sourced, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("sample source panicked: %v", p)
		}
	}()
	if out.msgs, err = src.SampleMessages(); err != nil {
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
func (r *record) callsOf(sampleID string) []*osmo.LLMCall {
	var out []*osmo.LLMCall
	for _, c := range r.calls {
		if c.SampleID == sampleID {
			out = append(out, c)
		}
	}
	return out
}

// mergeExtra lays a source's extra fields over the request's (a JSON
// object, or nothing).
func mergeExtra(base json.RawMessage, extra map[string]any) (json.RawMessage, error) {
	out := map[string]any{}
	if len(base) > 0 {
		if err := json.Unmarshal(base, &out); err != nil {
			return nil, err
		}
	}
	maps.Copy(out, extra)
	return json.Marshal(out)
}

// recordedConversation is the last successful call's request messages and
// its answer.
func recordedConversation(calls []*osmo.LLMCall) []json.RawMessage {
	whole := wholeRequests(calls)
	for i := len(calls) - 1; i >= 0; i-- {
		if c := calls[i]; c.Error == "" && len(c.ResponseMessage) > 0 {
			return append(whole[i][:len(whole[i]):len(whole[i])], c.ResponseMessage)
		}
	}
	return nil
}

// sampleMetrics sums a sample's calls. Its tool calls are those its agent
// recorded, or else those the policy asked for.
func sampleMetrics(calls []*osmo.LLMCall, tools toolStats, recorded bool, started time.Time) *osmo.SampleMetrics {
	m := callMetrics(calls, started, time.Now())
	if recorded {
		m.NumToolCalls, m.ToolLatencyMS = tools.n, ms(tools.latency)
		return m
	}
	for _, c := range calls {
		m.NumToolCalls += toolCalls(c.ResponseMessage)
	}
	return m
}

// toolCalls counts the tool calls of a response message.
func toolCalls(raw json.RawMessage) int {
	if len(raw) == 0 {
		return 0
	}
	var resp struct {
		ToolCalls []json.RawMessage `json:"tool_calls"`
	}
	if json.Unmarshal(raw, &resp) != nil {
		return 0
	}
	return len(resp.ToolCalls)
}
