package llmproxy

import (
	"bytes"

	"github.com/osmo-rl/osmo/internal/jsonscan"
)

// readCompletion is recordCompletion's reading of a body that json.Valid
// accepted and that starts with an object, without reflection: the record
// of every call read it, and encoding/json (a second pass over the body,
// a lookup by reflection for each key, an allocation for each value) was
// the proxy's largest single cost per call.
//
// It reads what decodeCompletion reads, to the same Call, and reports
// false, having set nothing, for anything it would not read exactly as
// encoding/json does: a key it reads written with escapes or in another
// case (encoding/json matches names without regard to case), one of them
// twice, a value of another type, a number out of its field's range.
// decodeCompletion reads those. FuzzRecordCompletion holds the two to the
// same record on any body.
func readCompletion(c *Call, data []byte) bool {
	var (
		id, finish             string
		message                []byte
		tokenIDs, promptIDs    []int32
		logprobs               []float64
		usage                  Usage
		hasUsage, hasPromptIDs bool
		hasChoice              bool
	)
	_, ok := jsonscan.Members(data, jsonscan.SkipSpace(data, 0), completionKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0: // id
			return jsonscan.String(b, i, &id)
		case 1: // choices
			return readChoices(b, i, func(i int) (int, bool) {
				hasChoice = true
				return readChoice(b, i, &message, &finish, &tokenIDs, &logprobs)
			})
		case 2: // usage
			if b[i] == 'n' {
				return i + 4, true
			}
			hasUsage = true
			return readUsage(b, i, &usage)
		default: // prompt_token_ids
			hasPromptIDs = true
			return jsonscan.Int32s(b, i, &promptIDs)
		}
	})
	if !ok {
		return false
	}
	c.ID = id
	if hasChoice {
		if len(message) > 0 && string(message) != "null" {
			c.ResponseMessage = bytes.Clone(message)
		}
		c.FinishReason, c.CompletionTokenIDs, c.Logprobs = finish, tokenIDs, logprobs
	}
	if hasUsage {
		c.Usage = usage
	}
	if hasPromptIDs {
		c.PromptTokenIDs = promptIDs
	}
	return true
}

// The keys read at each level, as completion's fields name them.
var (
	completionKeys = jsonscan.NewKeys("id", "choices", "usage", "prompt_token_ids")
	choiceKeys     = jsonscan.NewKeys("message", "finish_reason", "token_ids", "logprobs")
	logprobsKeys   = jsonscan.NewKeys("content")
	logprobKeys    = jsonscan.NewKeys("logprob")
	usageKeys      = jsonscan.NewKeys("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details")
	detailsKeys    = jsonscan.NewKeys("cached_tokens")
)

// readChoices calls first with the index of the first choice (null or an
// object), if there is one: the record reads no other.
func readChoices(b []byte, i int, first func(i int) (int, bool)) (int, bool) {
	n := 0
	end, _, ok := jsonscan.Array(b, i, func(i int) (int, bool) {
		n++
		if n > 1 {
			return jsonscan.SkipValue(b, i), true
		}
		return first(i)
	})
	return end, ok
}

func readChoice(b []byte, i int, message *[]byte, finish *string, tokenIDs *[]int32, logprobs *[]float64) (int, bool) {
	return jsonscan.Object(b, i, choiceKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0:
			end := jsonscan.SkipValue(b, i)
			*message = b[i:end]
			return end, true
		case 1:
			return jsonscan.String(b, i, finish)
		case 2:
			return jsonscan.Int32s(b, i, tokenIDs)
		default:
			return readLogprobs(b, i, logprobs)
		}
	})
}

// readLogprobs reads logprobs.content[].logprob: one value per token, 0
// where a token has none, as logprobsJSON.appendTo makes them.
func readLogprobs(b []byte, i int, out *[]float64) (int, bool) {
	return jsonscan.Object(b, i, logprobsKeys, func(_ int, b []byte, i int) (int, bool) {
		var lps []float64
		end, _, ok := jsonscan.Array(b, i, func(i int) (int, bool) {
			lp := 0.0
			end, ok := jsonscan.Object(b, i, logprobKeys, func(_ int, b []byte, i int) (int, bool) { return jsonscan.Float(b, i, &lp) })
			lps = append(lps, lp)
			return end, ok
		})
		*out = lps
		return end, ok
	})
}

func readUsage(b []byte, i int, u *Usage) (int, bool) {
	return jsonscan.Members(b, i, usageKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0:
			return jsonscan.Int(b, i, &u.PromptTokens)
		case 1:
			return jsonscan.Int(b, i, &u.CompletionTokens)
		case 2:
			return jsonscan.Int(b, i, &u.TotalTokens)
		default:
			return jsonscan.Object(b, i, detailsKeys, func(_ int, b []byte, i int) (int, bool) { return jsonscan.Int(b, i, &u.CachedTokens) })
		}
	})
}
