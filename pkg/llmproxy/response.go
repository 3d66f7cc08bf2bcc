package llmproxy

import (
	"bytes"
	"encoding/json"
	"errors"

	"github.com/osmo-rl/osmo"
)

// completion is the part of a chat completion, or of one chunk of a
// streamed one, that the record needs. Both answers are read into it by
// encoding/json, so a body is recorded alike whichever way it came: keys
// match as encoding/json matches them (in any case), a value of another
// type is skipped, the rest is still read.
type completion struct {
	ID             string   `json:"id"`
	Choices        []choice `json:"choices"`
	Usage          *usage   `json:"usage"`
	PromptTokenIDs []int32  `json:"prompt_token_ids"`
	// Error is set by an upstream that reports a failure mid-stream.
	Error json.RawMessage `json:"error"`
}

// choice is one of a completion's choices: Message in a whole answer,
// Delta in a chunk.
type choice struct {
	Index        int             `json:"index"`
	Message      json.RawMessage `json:"message"`
	Delta        delta           `json:"delta"`
	FinishReason string          `json:"finish_reason"`
	TokenIDs     []int32         `json:"token_ids"`
	Logprobs     *logprobs       `json:"logprobs"`
	// PromptTokenIDs is where SGLang puts them (vLLM: the completion's).
	PromptTokenIDs []int32 `json:"prompt_token_ids"`
}

// delta is what a chunk adds to the message.
type delta struct {
	Role             string `json:"role"`
	Content          string `json:"content"`
	ReasoningContent string `json:"reasoning_content"`
	Reasoning        string `json:"reasoning"`
	ToolCalls        []struct {
		Index    int    `json:"index"`
		ID       string `json:"id"`
		Type     string `json:"type"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

// choice0 is the first choice with index 0, the one the record holds (nil
// when there is none).
func (c *completion) choice0() *choice {
	for i := range c.Choices {
		if c.Choices[i].Index == 0 {
			return &c.Choices[i]
		}
	}
	return nil
}

// logprobs holds one entry per generated token: its logprob (0 where it
// has none) and the token as text.
type logprobs struct {
	Content []struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
	} `json:"content"`
}

// appendTo appends the logprobs to lps and the tokens to tokens.
func (l *logprobs) appendTo(lps []float64, tokens []string) ([]float64, []string) {
	if l == nil {
		return lps, tokens
	}
	for _, c := range l.Content {
		lps = append(lps, c.Logprob)
		tokens = append(tokens, c.Token)
	}
	return lps, tokens
}

// promptIDs are the completion's prompt token ids, wherever the engine
// put them.
func (c *completion) promptIDs(ch *choice) []int32 {
	if len(c.PromptTokenIDs) == 0 && ch != nil {
		return ch.PromptTokenIDs
	}
	return c.PromptTokenIDs
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usage) usage() osmo.Usage {
	out := osmo.Usage{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.TotalTokens}
	if u.PromptTokensDetails != nil {
		out.CachedTokens = u.PromptTokensDetails.CachedTokens
	}
	return out
}

// readCompletion reads one completion or chunk. It fails only when data is
// not JSON; fields of unexpected types are skipped, so an odd but
// well-formed answer is still recorded.
func readCompletion(data []byte) (completion, error) {
	var cr completion
	err := json.Unmarshal(data, &cr)
	if _, ok := errors.AsType[*json.SyntaxError](err); ok {
		return cr, err
	}
	return cr, nil
}

// recordCompletion fills c from a non-stream response body. It fails when
// the body is not a JSON object, which makes the attempt retryable.
func recordCompletion(c *osmo.LLMCall, data []byte) error {
	cr, err := readCompletion(data)
	switch {
	case err != nil:
		return errors.New("body is not valid JSON: " + err.Error())
	case !bytes.HasPrefix(bytes.TrimLeft(data, " \t\r\n"), []byte("{")):
		return errors.New("body is not a JSON object")
	}
	c.ID = cr.ID
	ch := cr.choice0()
	if ch != nil {
		if len(ch.Message) > 0 && string(ch.Message) != "null" {
			c.ResponseMessage = ch.Message
		}
		c.FinishReason = ch.FinishReason
		c.CompletionTokenIDs = ch.TokenIDs
		c.Logprobs, c.CompletionTokenStrings = ch.Logprobs.appendTo(nil, nil)
	}
	if cr.Usage != nil {
		c.Usage = cr.Usage.usage()
	}
	c.PromptTokenIDs = cr.promptIDs(ch)
	return nil
}
