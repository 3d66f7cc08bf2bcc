package osmoeino

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
)

// MessageError reports a message that cannot be converted: which one, which
// field, and why.
type MessageError struct {
	// Index is the message's position in the converted slice.
	Index int
	// Field is the offending field, as a JSON path inside the message
	// ("role", "tool_calls[0].function.name", "content[1].type").
	Field string
	Err   error
}

func (e *MessageError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("message %d: %v", e.Index, e.Err)
	}
	return fmt.Sprintf("message %d: %s: %v", e.Index, e.Field, e.Err)
}

func (e *MessageError) Unwrap() error { return e.Err }

func fieldErr(field, format string, args ...any) *MessageError {
	return &MessageError{Field: field, Err: fmt.Errorf(format, args...)}
}

// Content part types understood in both directions. Others (audio, video,
// files) have no single OpenAI chat shape across policy servers: they are
// refused rather than recorded in a shape the policy never saw.
const (
	partText  = "text"
	partImage = "image_url"
)

// SchemaMessages converts OpenAI chat messages (a workflow's prompt) to Eino
// messages: role, content (a string, null, or text and image_url parts;
// images only from users), name, tool_calls, tool_call_id and
// reasoning_content. A message it cannot convert is an error wrapping
// osmo.ErrInvalidInput and a *MessageError, so the rollout fails as invalid.
func SchemaMessages(msgs []osmo.Message) ([]*schema.Message, error) {
	out := make([]*schema.Message, 0, len(msgs))
	for i, m := range msgs {
		sm, err := schemaMessage(m)
		if err != nil {
			err.Index = i
			return nil, fmt.Errorf("osmoeino.SchemaMessages: %w: %w", osmo.ErrInvalidInput, err)
		}
		out = append(out, sm)
	}
	return out, nil
}

func schemaMessage(m osmo.Message) (*schema.Message, *MessageError) {
	if m == nil {
		return nil, &MessageError{Err: errors.New("message is null")}
	}
	role, ok := m["role"].(string)
	if !ok || role == "" {
		return nil, fieldErr("role", "missing or not a string")
	}
	switch role {
	case "system", "developer", "user", "assistant", "tool":
	default:
		return nil, fieldErr("role", "unknown role %q (want system, developer, user, assistant or tool)", role)
	}
	sm := &schema.Message{Role: schema.RoleType(role)}

	var err *MessageError
	if sm.Name, err = optionalString(m, "name"); err != nil {
		return nil, err
	}
	if sm.ReasoningContent, err = optionalString(m, "reasoning_content"); err != nil {
		return nil, err
	}
	if sm.ToolCallID, err = optionalString(m, "tool_call_id"); err != nil {
		return nil, err
	}
	if sm.Role == schema.Tool && sm.ToolCallID == "" {
		return nil, fieldErr("tool_call_id", "a tool message needs the id of the call it answers")
	}

	switch c := m["content"].(type) {
	case nil:
	case string:
		sm.Content = c
	default:
		parts, ok := asList(c)
		if !ok {
			return nil, fieldErr("content", "must be a string, a list of content parts or null, got %T", c)
		}
		if err := setContentParts(sm, parts); err != nil {
			return nil, err
		}
	}

	if raw, present := m["tool_calls"]; present && raw != nil {
		calls, ok := asList(raw)
		if !ok {
			return nil, fieldErr("tool_calls", "must be a list, got %T", raw)
		}
		if len(calls) > 0 && sm.Role != schema.Assistant {
			return nil, fieldErr("tool_calls", "only assistant messages carry tool calls, this one is %q", role)
		}
		for j, c := range calls {
			tc, err := schemaToolCall(c, fmt.Sprintf("tool_calls[%d]", j))
			if err != nil {
				return nil, err
			}
			sm.ToolCalls = append(sm.ToolCalls, tc)
		}
	}
	return sm, nil
}

// setContentParts fills sm from a list of content parts: user messages keep
// their parts (Eino sends them as parts again); other roles may only hold
// text, which Eino sends as one string, so the parts are joined.
func setContentParts(sm *schema.Message, parts []any) *MessageError {
	var text strings.Builder
	for j, p := range parts {
		field := fmt.Sprintf("content[%d]", j)
		part, ok := asObject(p)
		if !ok {
			return fieldErr(field, "must be an object, got %T", p)
		}
		typ, _ := part["type"].(string)
		switch typ {
		case partText:
			s, ok := part["text"].(string)
			if !ok {
				return fieldErr(field+".text", "missing or not a string")
			}
			if sm.Role == schema.User {
				sm.UserInputMultiContent = append(sm.UserInputMultiContent, schema.MessageInputPart{Type: schema.ChatMessagePartTypeText, Text: s})
			} else {
				text.WriteString(s)
			}
		case partImage:
			if sm.Role != schema.User {
				return fieldErr(field+".type", "image_url parts are only supported in user messages, this one is %q", sm.Role)
			}
			img, ok := asObject(part["image_url"])
			if !ok {
				return fieldErr(field+".image_url", "missing or not an object")
			}
			url, ok := img["url"].(string)
			if !ok || url == "" {
				return fieldErr(field+".image_url.url", "missing or not a string")
			}
			detail, _ := img["detail"].(string)
			sm.UserInputMultiContent = append(sm.UserInputMultiContent, schema.MessageInputPart{
				Type:  schema.ChatMessagePartTypeImageURL,
				Image: &schema.MessageInputImage{MessagePartCommon: schema.MessagePartCommon{URL: &url}, Detail: schema.ImageURLDetail(detail)},
			})
		default:
			return fieldErr(field+".type", "unsupported content part type %q (want text or image_url)", typ)
		}
	}
	if sm.Role != schema.User {
		sm.Content = text.String()
	}
	return nil
}

func schemaToolCall(v any, field string) (schema.ToolCall, *MessageError) {
	call, ok := asObject(v)
	if !ok {
		return schema.ToolCall{}, fieldErr(field, "must be an object, got %T", v)
	}
	id, ok := call["id"].(string)
	if !ok || id == "" {
		return schema.ToolCall{}, fieldErr(field+".id", "missing or not a string")
	}
	if typ, present := call["type"]; present && typ != "function" {
		return schema.ToolCall{}, fieldErr(field+".type", "unsupported tool call type %v (want function)", typ)
	}
	fn, ok := asObject(call["function"])
	if !ok {
		return schema.ToolCall{}, fieldErr(field+".function", "missing or not an object")
	}
	name, ok := fn["name"].(string)
	if !ok || name == "" {
		return schema.ToolCall{}, fieldErr(field+".function.name", "missing or not a string")
	}
	args, err := optionalString(fn, "arguments")
	if err != nil {
		err.Field = field + ".function." + err.Field
		return schema.ToolCall{}, err
	}
	return schema.ToolCall{ID: id, Type: "function", Function: schema.FunctionCall{Name: name, Arguments: args}}, nil
}

// ChatMessages converts Eino messages to OpenAI chat messages as JSON
// objects: role, content (a string; null for an assistant turn that only
// calls tools; a list of parts for multi-part content), name, tool_calls
// ([{id, type: "function", function: {name, arguments}}]), tool_call_id,
// and reasoning_content when the model produced reasoning. Values are JSON
// shapes (strings, []any, map[string]any), so the result compares equal to
// the same messages decoded from JSON.
func ChatMessages(msgs []*schema.Message) ([]osmo.Message, error) {
	out := make([]osmo.Message, 0, len(msgs))
	for i, m := range msgs {
		cm, err := chatMessage(m)
		if err != nil {
			err.Index = i
			return nil, fmt.Errorf("osmoeino.ChatMessages: %w", err)
		}
		out = append(out, cm)
	}
	return out, nil
}

func chatMessage(m *schema.Message) (osmo.Message, *MessageError) {
	if m == nil {
		return nil, &MessageError{Err: errors.New("message is nil")}
	}
	if m.Role == "" {
		return nil, fieldErr("role", "empty")
	}
	out := osmo.Message{"role": string(m.Role)}

	multi := 0
	for _, n := range []int{len(m.UserInputMultiContent), len(m.AssistantGenMultiContent), len(m.MultiContent)} {
		if n > 0 {
			multi++
		}
	}
	var err *MessageError
	switch {
	case multi > 1:
		return nil, fieldErr("content", "more than one kind of multi-part content is set")
	case multi == 1 && m.Content != "":
		// The OpenAI client refuses to send both, so no policy saw such a message.
		return nil, fieldErr("content", "both Content and multi-part content are set")
	case len(m.UserInputMultiContent) > 0:
		out["content"], err = inputParts(m.UserInputMultiContent)
	case len(m.AssistantGenMultiContent) > 0:
		out["content"], err = outputParts(m.AssistantGenMultiContent)
	case len(m.MultiContent) > 0:
		out["content"], err = legacyParts(m.MultiContent)
	case m.Content == "" && len(m.ToolCalls) > 0:
		out["content"] = nil
	default:
		out["content"] = m.Content
	}
	if err != nil {
		return nil, err
	}

	if m.Name != "" {
		out["name"] = m.Name
	}
	if len(m.ToolCalls) > 0 {
		calls := make([]any, 0, len(m.ToolCalls))
		for _, tc := range m.ToolCalls {
			calls = append(calls, map[string]any{
				"id":   tc.ID,
				"type": "function",
				"function": map[string]any{
					"name":      tc.Function.Name,
					"arguments": tc.Function.Arguments,
				},
			})
		}
		out["tool_calls"] = calls
	}
	if m.ToolCallID != "" {
		out["tool_call_id"] = m.ToolCallID
	}
	if m.ReasoningContent != "" {
		out["reasoning_content"] = m.ReasoningContent
	}
	return out, nil
}

func textPart(s string) map[string]any { return map[string]any{"type": partText, "text": s} }

func imagePart(url string, detail schema.ImageURLDetail) map[string]any {
	img := map[string]any{"url": url}
	if detail != "" {
		img["detail"] = string(detail)
	}
	return map[string]any{"type": partImage, "image_url": img}
}

func inputParts(parts []schema.MessageInputPart) ([]any, *MessageError) {
	out := make([]any, 0, len(parts))
	for j, p := range parts {
		field := fmt.Sprintf("content[%d]", j)
		switch p.Type {
		case schema.ChatMessagePartTypeText:
			out = append(out, textPart(p.Text))
		case schema.ChatMessagePartTypeImageURL:
			if p.Image == nil {
				return nil, fieldErr(field+".image", "nil for an image_url part")
			}
			url, err := imageURL(p.Image.MessagePartCommon)
			if err != nil {
				err.Field = field + ".image." + err.Field
				return nil, err
			}
			out = append(out, imagePart(url, p.Image.Detail))
		default:
			return nil, fieldErr(field+".type", "unsupported content part type %q (want text or image_url)", p.Type)
		}
	}
	return out, nil
}

func outputParts(parts []schema.MessageOutputPart) ([]any, *MessageError) {
	out := make([]any, 0, len(parts))
	for j, p := range parts {
		if p.Type != schema.ChatMessagePartTypeText {
			return nil, fieldErr(fmt.Sprintf("content[%d].type", j), "unsupported output part type %q (want text)", p.Type)
		}
		out = append(out, textPart(p.Text))
	}
	return out, nil
}

//lint:ignore SA1019 models built on older eino still fill MultiContent, so the adapter reads it too.
func legacyParts(parts []schema.ChatMessagePart) ([]any, *MessageError) {
	in := make([]schema.MessageInputPart, len(parts))
	for j, p := range parts {
		in[j] = schema.MessageInputPart{Type: p.Type, Text: p.Text}
		if p.ImageURL != nil {
			in[j].Image = &schema.MessageInputImage{MessagePartCommon: schema.MessagePartCommon{URL: &p.ImageURL.URL}, Detail: p.ImageURL.Detail}
		}
	}
	return inputParts(in)
}

// imageURL is what the OpenAI client sends for an image part: its URL, or
// its base64 data as a data URL.
func imageURL(c schema.MessagePartCommon) (string, *MessageError) {
	switch {
	case c.URL != nil && *c.URL != "":
		return *c.URL, nil
	case c.Base64Data != nil:
		if c.MIMEType == "" {
			return "", fieldErr("mime_type", "needed with base64 data")
		}
		return "data:" + c.MIMEType + ";base64," + *c.Base64Data, nil
	}
	return "", fieldErr("url", "an image part needs a URL or base64 data")
}

// optionalString reads m[key]: absent or null is "", a string is itself,
// anything else is an error naming key.
func optionalString(m map[string]any, key string) (string, *MessageError) {
	switch v := m[key].(type) {
	case nil:
		return "", nil
	case string:
		return v, nil
	default:
		return "", fieldErr(key, "must be a string, got %T", v)
	}
}

// asList accepts the list shapes a message can hold: decoded JSON ([]any)
// or values built in Go.
func asList(v any) ([]any, bool) {
	switch l := v.(type) {
	case []any:
		return l, true
	case []map[string]any:
		out := make([]any, len(l))
		for i, e := range l {
			out[i] = e
		}
		return out, true
	}
	return nil, false
}

func asObject(v any) (map[string]any, bool) {
	m, ok := v.(map[string]any)
	return m, ok && m != nil
}
