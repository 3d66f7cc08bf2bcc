package osmo

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Message is one chat message or conversation item, exactly as JSON carries it.
// OpenAI chat messages, OpenAI Agents session items and Strands messages all
// fit, so samples keep the shape their framework gave them.
type Message = map[string]any

// PlaceholderModel is the model id agents send; the trainer (or the proxy)
// routes it to the current policy.
const PlaceholderModel = "openai/osmosis-rollout"

// LastAssistantText returns the text of the last assistant message or item in
// messages, understanding OpenAI chat content (a string or a list of parts),
// OpenAI Agents output items ({"type":"message","content":[{"type":"output_text",...}]})
// and Strands content blocks ({"text": ...}). It returns "" when there is none.
func LastAssistantText(messages []Message) string {
	for i := len(messages) - 1; i >= 0; i-- {
		m := messages[i]
		if role, _ := m["role"].(string); role != "assistant" {
			continue
		}
		if text := contentText(m["content"]); text != "" {
			return text
		}
	}
	return ""
}

// contentText flattens a message's content into text.
func contentText(content any) string {
	switch c := content.(type) {
	case string:
		return c
	case []any:
		var parts []string
		for _, block := range c {
			b, ok := block.(map[string]any)
			if !ok {
				continue
			}
			for _, key := range []string{"text", "content"} {
				if s, ok := b[key].(string); ok && s != "" {
					parts = append(parts, s)
					break
				}
			}
		}
		return strings.Join(parts, "")
	}
	return ""
}

// CloneMessages deep-copies messages through JSON so a caller can keep them
// while the original slice keeps changing. Values that do not survive JSON are
// dropped, which is also what the wire would do.
func CloneMessages(messages []Message) []Message {
	if messages == nil {
		return nil
	}
	b, err := json.Marshal(messages)
	if err != nil {
		out := make([]Message, len(messages))
		copy(out, messages)
		return out
	}
	var out []Message
	if err := json.Unmarshal(b, &out); err != nil {
		return messages
	}
	return out
}

// EncodeMessages encodes messages as a SampleSource returns them; nil stays
// nil (the conversation the proxy recorded). The error names the first
// message that does not encode to a JSON object.
func EncodeMessages(messages []Message) ([]json.RawMessage, error) {
	if messages == nil {
		return nil, nil
	}
	out := make([]json.RawMessage, len(messages))
	for i, m := range messages {
		if m == nil {
			return nil, fmt.Errorf("message %d is null, not a JSON object", i)
		}
		b, err := json.Marshal(m)
		if err != nil {
			return nil, fmt.Errorf("message %d is not encodable as JSON: %w", i, err)
		}
		out[i] = b
	}
	return out, nil
}
