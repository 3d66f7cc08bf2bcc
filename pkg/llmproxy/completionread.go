package llmproxy

import (
	"bytes"
	"encoding/json"
	"strconv"
	"unicode/utf8"
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
	_, ok := eachMember(data, skipSpace(data, 0), completionKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0: // id
			return stringValue(b, i, &id)
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
			return int32s(b, i, &promptIDs)
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
	completionKeys = keys("id", "choices", "usage", "prompt_token_ids")
	choiceKeys     = keys("message", "finish_reason", "token_ids", "logprobs")
	logprobsKeys   = keys("content")
	logprobKeys    = keys("logprob")
	usageKeys      = keys("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details")
	detailsKeys    = keys("cached_tokens")
)

func keys(names ...string) [][]byte {
	out := make([][]byte, len(names))
	for i, n := range names {
		out[i] = []byte(n)
	}
	return out
}

// eachMember calls f with the index in want of each member's key, for
// the object at b[i] ('{'); f reads the member's value at b[vi] and
// returns the index after it. Members whose key is not wanted are passed
// over. It returns the index after the object, and reports false, and
// stops, where f does, and on a key it cannot match as encoding/json
// would (escaped, of another case, a second time). An object of 64 wanted
// keys or more is not read.
func eachMember(b []byte, i int, want [][]byte, f func(k int, b []byte, vi int) (int, bool)) (int, bool) {
	if i >= len(b) || b[i] != '{' || len(want) >= 64 {
		return i, false
	}
	var seen uint64
	i = skipSpace(b, i+1)
	for i < len(b) && b[i] != '}' {
		kEnd := skipString(b, i)
		key := b[i+1 : kEnd-1]
		i = skipSpace(b, skipSpace(b, kEnd)+1) // past ':'
		if bytes.IndexByte(key, '\\') >= 0 {
			return i, false
		}
		k := -1
		for j, w := range want {
			if bytes.Equal(key, w) {
				k = j
				break
			}
			if bytes.EqualFold(key, w) {
				return i, false
			}
		}
		if k < 0 {
			i = skipValue(b, i)
		} else {
			if seen&(1<<k) != 0 {
				return i, false
			}
			seen |= 1 << k
			var ok bool
			if i, ok = f(k, b, i); !ok {
				return i, false
			}
		}
		i = skipSpace(b, i)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return i + 1, true
}

// eachElement calls f with the index of each element of the array at
// b[i] ('['); f returns the index after the element. eachElement returns
// the index after the array, and reports false where f does.
func eachElement(b []byte, i int, f func(i int) (int, bool)) (int, bool) {
	i = skipSpace(b, i+1)
	for i < len(b) && b[i] != ']' {
		var ok bool
		if i, ok = f(i); !ok {
			return i, false
		}
		i = skipSpace(b, i)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return i + 1, true
}

// readChoices calls first with the index of the first choice (null or an
// object), if there is one: the record reads no other.
func readChoices(b []byte, i int, first func(i int) (int, bool)) (int, bool) {
	switch b[i] {
	case 'n':
		return i + 4, true
	case '[':
	default:
		return i, false
	}
	n := 0
	return eachElement(b, i, func(i int) (int, bool) {
		n++
		if n > 1 {
			return skipValue(b, i), true
		}
		return first(i)
	})
}

func readChoice(b []byte, i int, message *[]byte, finish *string, tokenIDs *[]int32, logprobs *[]float64) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	return eachMember(b, i, choiceKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0:
			end := skipValue(b, i)
			*message = b[i:end]
			return end, true
		case 1:
			return stringValue(b, i, finish)
		case 2:
			return int32s(b, i, tokenIDs)
		default:
			return readLogprobs(b, i, logprobs)
		}
	})
}

// readLogprobs reads logprobs.content[].logprob: one value per token, 0
// where a token has none, as logprobsJSON.appendTo makes them.
func readLogprobs(b []byte, i int, out *[]float64) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	return eachMember(b, i, logprobsKeys, func(_ int, b []byte, i int) (int, bool) {
		switch b[i] {
		case 'n':
			return i + 4, true
		case '[':
		default:
			return i, false
		}
		var lps []float64
		end, ok := eachElement(b, i, func(i int) (int, bool) {
			lp := 0.0
			end, ok := i+4, true
			if b[i] != 'n' {
				end, ok = eachMember(b, i, logprobKeys, func(_ int, b []byte, i int) (int, bool) { return float(b, i, &lp) })
			}
			lps = append(lps, lp)
			return end, ok
		})
		*out = lps
		return end, ok
	})
}

func readUsage(b []byte, i int, u *Usage) (int, bool) {
	return eachMember(b, i, usageKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0:
			return integer(b, i, &u.PromptTokens)
		case 1:
			return integer(b, i, &u.CompletionTokens)
		case 2:
			return integer(b, i, &u.TotalTokens)
		default:
			if b[i] == 'n' {
				return i + 4, true
			}
			return eachMember(b, i, detailsKeys, func(_ int, b []byte, i int) (int, bool) { return integer(b, i, &u.CachedTokens) })
		}
	})
}

// stringValue reads the string at b[i] into s (null leaves s as it is, as
// encoding/json does); encoding/json decodes a string with escapes or
// bytes that are not UTF-8 (which it replaces).
func stringValue(b []byte, i int, s *string) (int, bool) {
	switch b[i] {
	case 'n':
		return i + 4, true
	case '"':
	default:
		return i, false
	}
	end := skipString(b, i)
	inner := b[i+1 : end-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		*s = string(inner)
		return end, true
	}
	return end, json.Unmarshal(b[i:end], s) == nil
}

// int32s reads the array of integers at b[i], each within int32 (null is
// no array; [] an empty one, not none, as encoding/json makes it).
func int32s(b []byte, i int, out *[]int32) (int, bool) {
	switch b[i] {
	case 'n':
		*out = nil
		return i + 4, true
	case '[':
	default:
		return i, false
	}
	ids := make([]int32, 0, 16)
	end, ok := eachElement(b, i, func(i int) (int, bool) {
		end := skipValue(b, i)
		v := b[i:end]
		if !isInteger(v) {
			return end, false
		}
		n, err := strconv.ParseInt(string(v), 10, 32)
		ids = append(ids, int32(n))
		return end, err == nil
	})
	*out = ids
	return end, ok
}

// integer reads the int at b[i] (null leaves it as it is).
func integer(b []byte, i int, n *int) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	end := skipValue(b, i)
	if !isInteger(b[i:end]) {
		return end, false
	}
	x, err := strconv.ParseInt(string(b[i:end]), 10, 64)
	*n = int(x)
	return end, err == nil
}

// float reads the float64 at b[i] (null leaves it as it is).
func float(b []byte, i int, f *float64) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	end := skipValue(b, i)
	if c := b[i]; c != '-' && (c < '0' || c > '9') {
		return end, false
	}
	x, err := strconv.ParseFloat(string(b[i:end]), 64)
	*f = x
	return end, err == nil
}

// isInteger: a JSON number without fraction or exponent.
func isInteger(v []byte) bool {
	if len(v) == 0 || v[0] != '-' && (v[0] < '0' || v[0] > '9') {
		return false
	}
	return bytes.IndexAny(v, ".eE") < 0
}
