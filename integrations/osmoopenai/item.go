package osmoopenai

import (
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"

	"github.com/osmo-rl/osmo/internal/jsonenc"
)

// appendItem appends item's JSON as openai-go encodes it, byte for byte,
// for the messages every turn of a workflow adds: a system, developer, user
// or tool message whose content is a string, and an assistant message of
// a string content and function tool calls (what replyParam makes of most
// replies). openai-go encodes a param by reflecting over it, which was a
// tenth of a workflow's CPU. ok is false for any other param (content
// parts, a name, a refusal, extra fields, an override, a null): those go
// through json.Marshal. TestAppendItem holds the two encodings equal.
func appendItem(b []byte, item *openai.ChatCompletionMessageParamUnion) (_ []byte, ok bool) {
	if !plainUnion(item) {
		return b, false
	}
	switch {
	case item.OfSystem != nil:
		m := item.OfSystem
		return appendText(b, "system", textParts{m, &m.Content, m.Content.OfString, m.Content.OfArrayOfContentParts == nil, m.Name, m.Role == "" || m.Role == m.Role.Default()})
	case item.OfDeveloper != nil:
		m := item.OfDeveloper
		return appendText(b, "developer", textParts{m, &m.Content, m.Content.OfString, m.Content.OfArrayOfContentParts == nil, m.Name, m.Role == "" || m.Role == m.Role.Default()})
	case item.OfUser != nil:
		m := item.OfUser
		return appendText(b, "user", textParts{m, &m.Content, m.Content.OfString, m.Content.OfArrayOfContentParts == nil, m.Name, m.Role == "" || m.Role == m.Role.Default()})
	case item.OfTool != nil:
		m := item.OfTool
		if !plain(m) || !plainUnion(&m.Content) || (m.Role != "" && m.Role != m.Role.Default()) ||
			!isString(m.Content.OfString) || m.Content.OfArrayOfContentParts != nil {
			return b, false
		}
		b = append(b, `{"content":`...)
		b = jsonenc.AppendString(b, m.Content.OfString.Value)
		b = append(b, `,"tool_call_id":`...)
		b = jsonenc.AppendString(b, m.ToolCallID)
		return append(b, `,"role":"tool"}`...), true
	case item.OfAssistant != nil:
		return appendAssistant(b, item.OfAssistant)
	}
	return b, false
}

// textParts are what appendText reads of a system, developer or user
// message param, whose types differ but whose fields are the same.
type textParts struct {
	param, content metadataHolder
	text           param.Opt[string]
	noParts        bool // no content parts
	name           param.Opt[string]
	defaultRole    bool // the role is unset or the param's own
}

// appendText is appendItem's message of a role and a string content.
func appendText(b []byte, role string, m textParts) ([]byte, bool) {
	if !plain(m.param) || !plainUnion(m.content) || !m.noParts || m.name != (param.Opt[string]{}) || !m.defaultRole || !isString(m.text) {
		return b, false
	}
	b = append(b, `{"content":`...)
	b = jsonenc.AppendString(b, m.text.Value)
	b = append(b, `,"role":"`...)
	b = append(b, role...)
	return append(b, `"}`...), true
}

// appendAssistant is appendItem's assistant message: content (a string,
// or none), then function tool calls, then the role.
func appendAssistant(b []byte, m *openai.ChatCompletionAssistantMessageParam) ([]byte, bool) {
	if !plain(m) || !plainUnion(&m.Content) || (m.Role != "" && m.Role != m.Role.Default()) ||
		m.Refusal != (param.Opt[string]{}) || m.Name != (param.Opt[string]{}) ||
		m.Audio != (openai.ChatCompletionAssistantMessageParamAudio{}) ||
		m.FunctionCall != (openai.ChatCompletionAssistantMessageParamFunctionCall{}) || m.Content.OfArrayOfContentParts != nil {
		return b, false
	}
	hasContent := m.Content.OfString != (param.Opt[string]{})
	if hasContent && !isString(m.Content.OfString) {
		return b, false
	}
	for i := range m.ToolCalls {
		c := &m.ToolCalls[i]
		if !plainUnion(c) || c.OfCustom != nil || c.OfFunction == nil || !plain(c.OfFunction) || !plain(&c.OfFunction.Function) ||
			(c.OfFunction.Type != "" && c.OfFunction.Type != c.OfFunction.Type.Default()) {
			return b, false
		}
	}
	start := len(b)
	b = append(b, '{')
	if hasContent {
		b = append(b, `"content":`...)
		b = jsonenc.AppendString(b, m.Content.OfString.Value)
	}
	// openai-go omits an empty list as it omits none (omitzero).
	if len(m.ToolCalls) > 0 {
		if len(b) > start+1 {
			b = append(b, ',')
		}
		b = append(b, `"tool_calls":[`...)
		for i := range m.ToolCalls {
			f := m.ToolCalls[i].OfFunction
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"id":`...)
			b = jsonenc.AppendString(b, f.ID)
			// A function of no name and no arguments is its zero value,
			// which openai-go omits (omitzero).
			if f.Function.Arguments != "" || f.Function.Name != "" {
				b = append(b, `,"function":{"arguments":`...)
				b = jsonenc.AppendString(b, f.Function.Arguments)
				b = append(b, `,"name":`...)
				b = jsonenc.AppendString(b, f.Function.Name)
				b = append(b, '}')
			}
			b = append(b, `,"type":"function"}`...)
		}
		b = append(b, ']')
	}
	if len(b) > start+1 {
		b = append(b, ',')
	}
	return append(b, `"role":"assistant"}`...), true
}

// metadataHolder is what openai-go's param structs and unions embed: an
// override (param.Override, a null) or extra fields, which change their
// encoding.
type metadataHolder interface {
	Overrides() (any, bool)
	ExtraFields() map[string]any
}

// plain reports whether p encodes as its fields say: no override, no null,
// no extra fields.
func plain(p metadataHolder) bool {
	_, overridden := p.Overrides()
	return !overridden && len(p.ExtraFields()) == 0
}

// plainUnion is plain for a union, and for a message union also that
// exactly one variant is set.
func plainUnion(p metadataHolder) bool {
	if !plain(p) {
		return false
	}
	if u, ok := p.(*openai.ChatCompletionMessageParamUnion); ok {
		n := 0
		for _, set := range [...]bool{u.OfDeveloper != nil, u.OfSystem != nil, u.OfUser != nil, u.OfAssistant != nil, u.OfTool != nil, u.OfFunction != nil} {
			if set {
				n++
			}
		}
		return n == 1
	}
	return true
}

// isString reports whether o holds a string (not omitted, not null).
func isString(o param.Opt[string]) bool { return o.Valid() }
