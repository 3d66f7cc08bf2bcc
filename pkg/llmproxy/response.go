package llmproxy

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/osmo-rl/osmo/internal/jsonscan"
)

// completion is the part of a chat completion the record needs. Raw fields
// are kept as bytes; nothing else is decoded.
type completion struct {
	ID      string `json:"id"`
	Choices []struct {
		Message      json.RawMessage `json:"message"`
		FinishReason string          `json:"finish_reason"`
		TokenIDs     []int32         `json:"token_ids"`
		Logprobs     *logprobsJSON   `json:"logprobs"`
	} `json:"choices"`
	Usage          *usageJSON `json:"usage"`
	PromptTokenIDs []int32    `json:"prompt_token_ids"`
}

type logprobsJSON struct {
	Content []struct {
		Logprob float64 `json:"logprob"`
	} `json:"content"`
}

func (l *logprobsJSON) appendTo(dst []float64) []float64 {
	if l == nil {
		return dst
	}
	for _, c := range l.Content {
		dst = append(dst, c.Logprob)
	}
	return dst
}

type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usageJSON) usage() Usage {
	out := Usage{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.TotalTokens}
	if u.PromptTokensDetails != nil {
		out.CachedTokens = u.PromptTokensDetails.CachedTokens
	}
	return out
}

// recordCompletion fills c from a non-stream response body. It fails only
// when the body is not a JSON object, which makes the attempt retryable;
// fields of unexpected types are skipped so an odd but well-formed answer
// still reaches the client.
func recordCompletion(c *Call, data []byte) error {
	if i := jsonscan.SkipSpace(data, 0); i >= len(data) || data[i] != '{' {
		if !json.Valid(data) {
			return errors.New("body is not valid JSON")
		}
		return errors.New("body is not a JSON object")
	}
	if !json.Valid(data) {
		var v any
		return fmt.Errorf("body is not valid JSON: %w", json.Unmarshal(data, &v))
	}
	if readCompletion(c, data) {
		return nil
	}
	decodeCompletion(c, data)
	return nil
}

// decodeCompletion is recordCompletion's reading of a body that is a
// valid JSON object, by encoding/json.
func decodeCompletion(c *Call, data []byte) {
	var cr completion
	_ = json.Unmarshal(data, &cr) // valid: only fields of other types fail
	c.ID = cr.ID
	if len(cr.Choices) > 0 {
		ch := &cr.Choices[0]
		if len(ch.Message) > 0 && string(ch.Message) != "null" {
			c.ResponseMessage = ch.Message
		}
		c.FinishReason = ch.FinishReason
		c.CompletionTokenIDs = ch.TokenIDs
		c.Logprobs = ch.Logprobs.appendTo(nil)
	}
	if cr.Usage != nil {
		c.Usage = cr.Usage.usage()
	}
	c.PromptTokenIDs = cr.PromptTokenIDs
}
