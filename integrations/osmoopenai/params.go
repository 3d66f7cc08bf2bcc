package osmoopenai

import (
	"math"
	"reflect"
	"slices"
	"strconv"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"

	"github.com/osmo-rl/osmo/internal/jsonenc"
)

// writeParams is encodeParams written field by field, for the params a
// workflow usually sends: a model, sampling options of a number, a flag or
// a string, and tools that are all Run's own. It returns nil for anything
// else, which encodeParams encodes through openai-go.
//
// openai-go encodes params by reflection (each Opt through its own
// MarshalJSON) and every tool schema, a map, with its keys sorted: 10 to
// 13 µs a Run, and enough stack that it runs on a goroutine of its own
// (encodeParams). These are the same bytes, in the same order
// (TestWriteParamsIsOpenAI), without either.
//
// own are the tools params.Tools were built from (by offer): params.Tools
// must hold theirs and nothing else.
func writeParams(params *openai.ChatCompletionNewParams, own []Tool) *encodedParams {
	if len(params.Tools) != len(own) || !onlyScalars(params) {
		return nil
	}
	rest, ok := appendScalars(make([]byte, 0, 128), params)
	if !ok {
		return nil
	}
	enc := &encodedParams{rest: rest}
	// An empty list of tools, not nil, is written: [] (openai-go's
	// omitzero omits only nil).
	if params.Tools != nil {
		b := append(make([]byte, 0, 256*len(own)), '[')
		for i, t := range own {
			if i > 0 {
				b = append(b, ',')
			}
			if b, ok = appendTool(b, t); !ok {
				return nil
			}
		}
		enc.tools = append(b, ']')
	}
	return enc
}

// onlyScalars reports whether params set nothing but what appendScalars
// writes (and their messages and tools, which are written apart). Every
// field is looked at, by reflection, so that a field openai-go adds later
// is caught here too.
func onlyScalars(params *openai.ChatCompletionNewParams) bool {
	v := reflect.ValueOf(params).Elem()
	t := v.Type()
	for i := range t.NumField() {
		if !v.Field(i).IsZero() && !writtenApart(t.Field(i).Name) {
			return false
		}
	}
	return true
}

// writtenApart reports whether appendScalars (or requestBody, for
// Messages and Tools) writes the ChatCompletionNewParams field named.
func writtenApart(field string) bool {
	switch field {
	case "Messages", "Tools", "Model",
		"FrequencyPenalty", "PresencePenalty", "Temperature", "TopP",
		"MaxCompletionTokens", "MaxTokens", "N", "Seed", "TopLogprobs",
		"Logprobs", "Store", "ParallelToolCalls",
		"PromptCacheKey", "SafetyIdentifier", "User",
		"ReasoningEffort", "ServiceTier", "Verbosity", "PromptCacheRetention":
		return true
	}
	return false
}

// appendScalars writes the fields onlyScalars allows as one object, in the
// order openai-go writes them (the struct's). It reports false for a field
// set to null, or a number JSON has no form for, which openai-go handles
// (the one by writing null, the other by refusing the params).
func appendScalars(b []byte, p *openai.ChatCompletionNewParams) ([]byte, bool) {
	w := scalarWriter{b: append(b, '{'), ok: true}
	w.str("model", string(p.Model))
	w.float("frequency_penalty", p.FrequencyPenalty)
	w.flag("logprobs", p.Logprobs)
	w.int("max_completion_tokens", p.MaxCompletionTokens)
	w.int("max_tokens", p.MaxTokens)
	w.int("n", p.N)
	w.float("presence_penalty", p.PresencePenalty)
	w.optStr("prompt_cache_key", p.PromptCacheKey)
	w.optStr("safety_identifier", p.SafetyIdentifier)
	w.int("seed", p.Seed)
	w.flag("store", p.Store)
	w.float("temperature", p.Temperature)
	w.int("top_logprobs", p.TopLogprobs)
	w.float("top_p", p.TopP)
	w.flag("parallel_tool_calls", p.ParallelToolCalls)
	w.optStr("user", p.User)
	w.str("prompt_cache_retention", string(p.PromptCacheRetention))
	w.str("reasoning_effort", string(p.ReasoningEffort))
	w.str("service_tier", string(p.ServiceTier))
	w.str("verbosity", string(p.Verbosity))
	return append(w.b, '}'), w.ok
}

// scalarWriter writes an object's fields, each omitted when zero as
// openai-go's omitzero omits it.
type scalarWriter struct {
	b  []byte
	ok bool
}

func (w *scalarWriter) key(k string) {
	if len(w.b) > 1 {
		w.b = append(w.b, ',')
	}
	w.b = append(append(append(w.b, '"'), k...), '"', ':')
}

func (w *scalarWriter) str(k, v string) {
	if v != "" {
		w.key(k)
		w.b = jsonenc.AppendString(w.b, v)
	}
}

// set reports whether o is to be written: not omitted (the zero Opt), and
// not null, which clears ok.
func set[T comparable](w *scalarWriter, o param.Opt[T]) bool {
	if o == (param.Opt[T]{}) {
		return false
	}
	if !o.Valid() {
		w.ok = false
		return false
	}
	return true
}

func (w *scalarWriter) optStr(k string, o param.Opt[string]) {
	if set(w, o) {
		w.key(k)
		w.b = jsonenc.AppendString(w.b, o.Value)
	}
}

func (w *scalarWriter) float(k string, o param.Opt[float64]) {
	if !set(w, o) {
		return
	}
	if math.IsNaN(o.Value) || math.IsInf(o.Value, 0) {
		w.ok = false
		return
	}
	w.key(k)
	w.b = jsonenc.AppendFloat(w.b, o.Value)
}

func (w *scalarWriter) int(k string, o param.Opt[int64]) {
	if set(w, o) {
		w.key(k)
		w.b = strconv.AppendInt(w.b, o.Value, 10)
	}
}

func (w *scalarWriter) flag(k string, o param.Opt[bool]) {
	if set(w, o) {
		w.key(k)
		w.b = strconv.AppendBool(w.b, o.Value)
	}
}

// appendTool writes t as openai-go writes t.param(): a function tool, its
// schema as encoding/json writes a map (keys sorted, HTML escaped), which
// is what openai-go's copy of encoding/json writes for plain JSON values.
// It reports false for a schema holding anything else.
func appendTool(b []byte, t Tool) ([]byte, bool) {
	b = append(b, `{"function":{"name":`...)
	b = jsonenc.AppendString(b, t.Name)
	if t.Description != "" {
		b = append(b, `,"description":`...)
		b = jsonenc.AppendString(b, t.Description)
	}
	if t.Parameters != nil {
		var ok bool
		if b, ok = appendPlain(append(b, `,"parameters":`...), t.Parameters, 0); !ok {
			return b, false
		}
	}
	return append(b, `},"type":"function"}`...), true
}

// appendPlain writes v, made only of what a JSON document decodes to in Go
// (maps of any, slices of any, strings, float64s, bools, nil) and the ints
// and string slices a schema is often written with, as encoding/json
// writes it. It reports false for anything else (a struct, a Marshaler, a
// json.Number, which openai-go writes as a string), a number JSON has no
// form for, and nesting deeper than 64: openai-go encodes those. Its
// frames are small: it runs on a rollout's goroutine (see encodeParams).
func appendPlain(b []byte, v any, depth int) ([]byte, bool) {
	if depth > 64 {
		return b, false
	}
	ok := true
	switch v := v.(type) {
	case nil:
		b = append(b, "null"...)
	case string:
		b = jsonenc.AppendString(b, v)
	case bool:
		b = strconv.AppendBool(b, v)
	case int:
		b = strconv.AppendInt(b, int64(v), 10)
	case int64:
		b = strconv.AppendInt(b, v, 10)
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return b, false
		}
		b = jsonenc.AppendFloat(b, v)
	case []string:
		if v == nil {
			return append(b, "null"...), true
		}
		b = append(b, '[')
		for i, e := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = jsonenc.AppendString(b, e)
		}
		b = append(b, ']')
	case []any:
		if v == nil {
			return append(b, "null"...), true
		}
		b = append(b, '[')
		for i, e := range v {
			if i > 0 {
				b = append(b, ',')
			}
			if b, ok = appendPlain(b, e, depth+1); !ok {
				return b, false
			}
		}
		b = append(b, ']')
	case map[string]any:
		if v == nil {
			return append(b, "null"...), true
		}
		// The keys in a plain loop, not an iterator's: fewer frames.
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(jsonenc.AppendString(b, k), ':')
			if b, ok = appendPlain(b, v[k], depth+1); !ok {
				return b, false
			}
		}
		b = append(b, '}')
	default:
		return b, false
	}
	return b, true
}
