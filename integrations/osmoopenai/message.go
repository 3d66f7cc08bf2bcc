package osmoopenai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"

	"github.com/osmo-rl/osmo"
)

// MessageError reports a message that is not a valid OpenAI chat message
// param, naming the message and the field.
type MessageError struct {
	// Index is the message's position in the list converted (0 for
	// MessageParam).
	Index int
	// Field is the JSON path of the offending field within the message,
	// such as "role" or "content[0].text"; empty for the message as a whole.
	Field  string
	Reason string
}

func (e *MessageError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("osmoopenai: message %d: %s", e.Index, e.Reason)
	}
	return fmt.Sprintf("osmoopenai: message %d: field %q: %s", e.Index, e.Field, e.Reason)
}

// chatRoles are the roles of the OpenAI chat message params.
var chatRoles = map[string]bool{"developer": true, "system": true, "user": true, "assistant": true, "tool": true, "function": true}

// MessageParam converts one message as JSON carries it (a dataset prompt
// row, a recorded sample) into an OpenAI chat message param. The conversion
// goes through JSON, and it is strict: a message with an unknown role, or
// with a field the param would silently drop or change (an unknown key, a
// content of the wrong type), is a *MessageError naming that field rather
// than a request that quietly differs from the input.
func MessageParam(m osmo.Message) (openai.ChatCompletionMessageParamUnion, error) {
	return messageParam(0, m)
}

// MessageParams converts messages with MessageParam; the error names the
// first message that does not convert.
func MessageParams(messages []osmo.Message) ([]openai.ChatCompletionMessageParamUnion, error) {
	out := make([]openai.ChatCompletionMessageParamUnion, 0, len(messages))
	for i, m := range messages {
		p, err := messageParam(i, m)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

func messageParam(i int, m osmo.Message) (openai.ChatCompletionMessageParamUnion, error) {
	var p openai.ChatCompletionMessageParamUnion
	if m == nil {
		return p, &MessageError{Index: i, Reason: "message is null"}
	}
	role, ok := m["role"].(string)
	switch {
	case m["role"] == nil:
		return p, &MessageError{Index: i, Field: "role", Reason: "missing"}
	case !ok:
		return p, &MessageError{Index: i, Field: "role", Reason: fmt.Sprintf("must be a string, got %T", m["role"])}
	case !chatRoles[role]:
		return p, &MessageError{Index: i, Field: "role", Reason: fmt.Sprintf("unknown role %q (want developer, system, user, assistant, tool or function)", role)}
	}
	in, err := json.Marshal(m)
	if err != nil {
		return p, &MessageError{Index: i, Reason: fmt.Sprintf("not JSON: %v", err)}
	}
	if err := json.Unmarshal(in, &p); err != nil {
		return p, &MessageError{Index: i, Reason: fmt.Sprintf("not an OpenAI %s message: %v", role, err)}
	}
	out, err := json.Marshal(p)
	if err != nil {
		return p, &MessageError{Index: i, Reason: fmt.Sprintf("encode as OpenAI %s message: %v", role, err)}
	}
	if bytes.Equal(in, out) {
		// The usual case (a message's keys in the order both encode them):
		// nothing was lost, and nothing need be decoded to tell.
		return p, nil
	}
	var before, after any
	if err := json.Unmarshal(in, &before); err != nil {
		return p, &MessageError{Index: i, Reason: fmt.Sprintf("not JSON: %v", err)}
	}
	if err := json.Unmarshal(out, &after); err != nil {
		return p, &MessageError{Index: i, Reason: fmt.Sprintf("encode as OpenAI %s message: %v", role, err)}
	}
	if path := firstLoss(before, after, ""); path != "" {
		return p, &MessageError{Index: i, Field: path, Reason: fmt.Sprintf("not a field of an OpenAI %s message, or of the wrong type", role)}
	}
	return p, nil
}

// firstLoss returns the path of the first value of in (a decoded JSON value)
// that out lacks or holds differently; "" when out keeps all of in. Nulls in
// in stand for absent values and may be dropped.
func firstLoss(in, out any, path string) string {
	switch a := in.(type) {
	case nil:
		return ""
	case map[string]any:
		b, ok := out.(map[string]any)
		if !ok {
			return pathOr(path)
		}
		for _, k := range slices.Sorted(maps.Keys(a)) {
			if p := firstLoss(a[k], b[k], join(path, k)); p != "" {
				return p
			}
		}
		return ""
	case []any:
		b, ok := out.([]any)
		if !ok || len(a) != len(b) {
			return pathOr(path)
		}
		for i := range a {
			if p := firstLoss(a[i], b[i], path+"["+strconv.Itoa(i)+"]"); p != "" {
				return p
			}
		}
		return ""
	}
	if !reflect.DeepEqual(in, out) {
		return pathOr(path)
	}
	return ""
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// pathOr names the whole message when the loss is at its root.
func pathOr(path string) string {
	if path == "" {
		return "."
	}
	return path
}

// A session keeps each message as the JSON object openai-go encodes its
// param to. The three functions below are the only conversions between
// that, openai-go's message params and osmo's messages (MessageParam is
// the fourth, from osmo's).

// encodeItem is a message param as a session keeps it, which must be a
// JSON object.
func encodeItem(item openai.ChatCompletionMessageParamUnion) (json.RawMessage, error) {
	raw, err := json.Marshal(item)
	if err != nil {
		return nil, fmt.Errorf("encode message: %w", err)
	}
	// json.Marshal checks what a MarshalJSON returns and compacts it:
	// the first byte tells an object.
	if len(raw) == 0 || raw[0] != '{' {
		return nil, fmt.Errorf("message encodes to %s, not a JSON object", truncate(raw, 64))
	}
	return raw, nil
}

// requestMessages are a session's items as the messages of a request:
// params that openai-go encodes to exactly those objects.
func requestMessages(items []json.RawMessage) []openai.ChatCompletionMessageParamUnion {
	msgs := make([]openai.ChatCompletionMessageParamUnion, len(items))
	for i, raw := range items {
		msgs[i] = param.Override[openai.ChatCompletionMessageParamUnion](raw)
	}
	return msgs
}

// sampleMessages are a session's items as osmo messages, fresh copies.
func sampleMessages(items []json.RawMessage) []osmo.Message {
	out := make([]osmo.Message, 0, len(items))
	for _, raw := range items {
		var m osmo.Message
		// Every item was checked to be a JSON object when added.
		_ = json.Unmarshal(raw, &m)
		out = append(out, m)
	}
	return out
}

func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "..."
}
