package osmo

import (
	"encoding/json"
	"fmt"
)

// ChatResult is one chat completion as an agent loop sees it.
type ChatResult struct {
	// ID is the upstream response id.
	ID string
	// Message is choices[0].message, to append to the history as is.
	Message Message
	// FinishReason is choices[0].finish_reason.
	FinishReason string
	// ToolCalls are the message's tool calls, decoded.
	ToolCalls []ToolCall
	Usage     Usage
}

// HasToolCalls reports whether the model asked for tools.
func (r *ChatResult) HasToolCalls() bool { return len(r.ToolCalls) > 0 }

// Usage is the token accounting of a completion. CachedTokens is what
// OpenAI reports as usage.prompt_tokens_details.cached_tokens.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	CachedTokens     int `json:"cached_tokens"`
}

// ToolCall is an OpenAI tool call.
type ToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function FunctionCall `json:"function"`
}

// FunctionCall names the function and carries its arguments as JSON text.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// parseChatCompletion decodes an OpenAI chat completion body into a ChatResult.
func parseChatCompletion(body []byte) (*ChatResult, error) {
	var resp struct {
		ID      string `json:"id"`
		Choices []struct {
			Message      Message `json:"message"`
			FinishReason string  `json:"finish_reason"`
		} `json:"choices"`
		Usage Usage `json:"usage"`
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		return nil, fmt.Errorf("osmo: malformed chat completion: %w", err)
	}
	if len(resp.Choices) == 0 {
		return nil, fmt.Errorf("osmo: chat completion has no choices")
	}
	ch := resp.Choices[0]
	if ch.Message == nil {
		return nil, fmt.Errorf("osmo: chat completion choice has no message")
	}
	res := &ChatResult{ID: resp.ID, Message: ch.Message, FinishReason: ch.FinishReason, Usage: resp.Usage}
	if raw, ok := ch.Message["tool_calls"]; ok && raw != nil {
		b, err := json.Marshal(raw)
		if err != nil {
			return nil, fmt.Errorf("osmo: tool_calls: %w", err)
		}
		if err := json.Unmarshal(b, &res.ToolCalls); err != nil {
			return nil, fmt.Errorf("osmo: malformed tool_calls: %w", err)
		}
	}
	return res, nil
}
