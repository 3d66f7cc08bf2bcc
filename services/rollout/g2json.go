package rollout

import (
	"slices"
	"strconv"

	"github.com/osmo-rl/osmo/internal/jsonenc"
)

// jsonAppender is a callback body that writes its own JSON: what
// json.Marshal writes for it, byte for byte (TestGraderBodyJSON), without
// the reflection over every field and the second pass json.Marshal makes
// over what each MarshalJSON returns. The grader callback, the largest
// body by far, is one.
type jsonAppender interface {
	appendJSON(b []byte) []byte
}

func (c *g2GraderCallback) appendJSON(b []byte) []byte {
	b = append(b, `{"status":`...)
	b = jsonenc.AppendString(b, c.Status)
	b = append(b, `,"rollout_id":`...)
	b = jsonenc.AppendString(b, c.RolloutID)
	b = append(b, `,"err_message":`...)
	b = appendOptString(b, c.ErrMessage)
	b = append(b, `,"err_category":`...)
	b = appendOptString(b, c.ErrCategory)
	// sample is one of samples (v0.3's field beside G2's): it is written
	// once, at sampleAt in b, and copied from there.
	sampleAt, sampleEnd := -1, -1
	b = append(b, `,"samples":`...)
	if c.Samples == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '{')
		keys := make([]string, 0, len(c.Samples))
		for k := range c.Samples {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = jsonenc.AppendString(b, k)
			b = append(b, ':')
			start := len(b)
			b = c.Samples[k].appendJSON(b)
			if c.Sample != nil && c.Samples[k] == c.Sample {
				sampleAt, sampleEnd = start, len(b)
			}
		}
		b = append(b, '}')
	}
	b = append(b, `,"sample":`...)
	if sampleAt >= 0 {
		b = append(b, b[sampleAt:sampleEnd]...)
	} else {
		b = c.Sample.appendJSON(b)
	}
	return append(b, '}')
}

func (s *wireSample) appendJSON(b []byte) []byte {
	if s == nil {
		return append(b, "null"...)
	}
	b = append(b, `{"id":`...)
	b = jsonenc.AppendString(b, s.ID)
	b = append(b, `,"messages":`...)
	b = appendStructs(b, s.Messages)
	b = append(b, `,"label":`...)
	b = appendOptString(b, s.Label)
	b = append(b, `,"reward":`...)
	if s.Reward == nil {
		b = append(b, "null"...)
	} else {
		b = appendNumber(b, *s.Reward)
	}
	b = append(b, `,"remove_sample":`...)
	b = strconv.AppendBool(b, s.RemoveSample)
	b = append(b, `,"metrics":`...)
	b = s.Metrics.appendJSON(b)
	b = append(b, `,"extra_fields":`...)
	b = s.ExtraFields.append(b)
	if len(s.LLMCalls) > 0 {
		b = append(b, `,"llm_calls":[`...)
		for i, c := range s.LLMCalls {
			if i > 0 {
				b = append(b, ',')
			}
			b = c.appendJSON(b)
		}
		b = append(b, ']')
	}
	return append(b, '}')
}

func (m *wireMetrics) appendJSON(b []byte) []byte {
	if m == nil {
		return append(b, "null"...)
	}
	b = append(b, `{"llm_latency_ms":`...)
	b = m.LlmLatencyMs.append(b)
	b = append(b, `,"max_context_tokens":`...)
	b = strconv.AppendInt(b, int64(m.MaxContextTokens), 10)
	b = append(b, `,"num_llm_calls":`...)
	b = strconv.AppendInt(b, int64(m.NumLlmCalls), 10)
	b = append(b, `,"num_tool_calls":`...)
	b = strconv.AppendInt(b, int64(m.NumToolCalls), 10)
	b = append(b, `,"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(m.PromptTokens), 10)
	b = append(b, `,"response_tokens":`...)
	b = strconv.AppendInt(b, int64(m.ResponseTokens), 10)
	b = append(b, `,"tool_latency_ms":`...)
	b = m.ToolLatencyMs.append(b)
	b = append(b, `,"total_latency_ms":`...)
	b = m.TotalLatencyMs.append(b)
	return append(b, '}')
}

func (c *wireLLMCall) appendJSON(b []byte) []byte {
	if c == nil {
		return append(b, "null"...)
	}
	b = append(b, `{"id":`...)
	b = jsonenc.AppendString(b, c.ID)
	b = append(b, `,"requested_model":`...)
	b = jsonenc.AppendString(b, c.RequestedModel)
	b = append(b, `,"model":`...)
	b = jsonenc.AppendString(b, c.Model)
	b = append(b, `,"request_messages":`...)
	b = appendStructs(b, c.RequestMessages)
	b = append(b, `,"shared_request_messages":`...)
	b = strconv.AppendInt(b, int64(c.SharedRequestMessages), 10)
	b = append(b, `,"response_message":`...)
	b = c.ResponseMessage.append(b)
	b = append(b, `,"finish_reason":`...)
	b = jsonenc.AppendString(b, c.FinishReason)
	b = append(b, `,"usage":`...)
	if u := c.Usage; u == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, `{"prompt_tokens":`...)
		b = strconv.AppendInt(b, int64(u.PromptTokens), 10)
		b = append(b, `,"completion_tokens":`...)
		b = strconv.AppendInt(b, int64(u.CompletionTokens), 10)
		b = append(b, `,"total_tokens":`...)
		b = strconv.AppendInt(b, int64(u.TotalTokens), 10)
		b = append(b, `,"cached_tokens":`...)
		b = strconv.AppendInt(b, int64(u.CachedTokens), 10)
		b = append(b, '}')
	}
	b = append(b, `,"latency_ms":`...)
	b = c.LatencyMS.append(b)
	b = append(b, `,"time_to_first_token_ms":`...)
	b = c.TimeToFirstTokenMS.append(b)
	b = append(b, `,"stream":`...)
	b = strconv.AppendBool(b, c.Stream)
	if len(c.PromptTokenIDs) > 0 {
		b = append(b, `,"prompt_token_ids":`...)
		b = appendInt32s(b, c.PromptTokenIDs)
	}
	if len(c.CompletionTokenIDs) > 0 {
		b = append(b, `,"completion_token_ids":`...)
		b = appendInt32s(b, c.CompletionTokenIDs)
	}
	if len(c.Logprobs) > 0 {
		b = append(b, `,"logprobs":`...)
		b = c.Logprobs.append(b)
	}
	b = append(b, `,"status_code":`...)
	b = strconv.AppendInt(b, int64(c.StatusCode), 10)
	b = append(b, `,"error":`...)
	b = jsonenc.AppendString(b, c.Error)
	b = append(b, `,"attempts":`...)
	b = strconv.AppendInt(b, int64(c.Attempts), 10)
	b = append(b, `,"started_at":`...)
	if len(c.StartedAt) == 0 {
		b = append(b, "null"...)
	} else {
		b = append(b, c.StartedAt...) // "null" or a quoted timestamp
	}
	b = append(b, `,"api":`...)
	b = jsonenc.AppendString(b, c.API)
	b = append(b, `,"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(c.PromptTokens), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(c.CompletionTokens), 10)
	b = append(b, `,"cached_tokens":`...)
	b = strconv.AppendInt(b, int64(c.CachedTokens), 10)
	b = append(b, `,"model_name":`...)
	b = jsonenc.AppendString(b, c.ModelName)
	return append(b, '}')
}

// append writes j as its MarshalJSON does.
func (j jsonStruct) append(b []byte) []byte {
	if j.s == nil {
		return append(b, "null"...)
	}
	return appendStruct(b, j.s)
}

func appendStructs(b []byte, ss []jsonStruct) []byte {
	if ss == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = s.append(b)
	}
	return append(b, ']')
}

func appendOptString(b []byte, s *string) []byte {
	if s == nil {
		return append(b, "null"...)
	}
	return jsonenc.AppendString(b, *s)
}

func appendInt32s(b []byte, ns []int32) []byte {
	b = append(b, '[')
	for i, n := range ns {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(n), 10)
	}
	return append(b, ']')
}
