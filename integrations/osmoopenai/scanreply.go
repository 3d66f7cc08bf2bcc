package osmoopenai

import "github.com/osmo-rl/osmo/internal/jsonscan"

// scanReply reads into r what encoding/json would of a reply json.Valid
// accepted (r's first choice only: decodeLean reads no other), in one
// pass, without reflection and with little stack, and reports false,
// leaving r to be decoded by encoding/json, for anything it would not read
// exactly so: a key escaped, in another case or given twice, a value of
// another type (see jsonscan). FuzzScanReply holds the two to the same
// reply.
func scanReply(b []byte, r *leanReply) bool {
	_, ok := jsonscan.Members(b, jsonscan.SkipSpace(b, 0), replyKeys, func(k int, b []byte, i int) (int, bool) {
		if k == 0 {
			return jsonscan.String(b, i, &r.ID)
		}
		choices := []leanChoice{} // [] is no choice, but not none
		end, null, ok := jsonscan.Array(b, i, func(i int) (int, bool) {
			if len(choices) > 0 {
				return jsonscan.SkipValue(b, i), true
			}
			choices = make([]leanChoice, 1)
			return scanChoice(b, i, &choices[0])
		})
		if !null {
			r.Choices = choices
		}
		return end, ok
	})
	return ok
}

var (
	replyKeys    = jsonscan.NewKeys("id", "choices")
	choiceKeys   = jsonscan.NewKeys("finish_reason", "message")
	messageKeys  = jsonscan.NewKeys("role", "content", "refusal", "audio", "function_call", "tool_calls")
	audioKeys    = jsonscan.NewKeys("id")
	functionKeys = jsonscan.NewKeys("name", "arguments")
	toolCallKeys = jsonscan.NewKeys("id", "type", "function", "custom")
	customKeys   = jsonscan.NewKeys("name", "input")
)

func scanChoice(b []byte, i int, c *leanChoice) (int, bool) {
	return jsonscan.Object(b, i, choiceKeys, func(k int, b []byte, i int) (int, bool) {
		if k == 0 {
			return jsonscan.String(b, i, &c.FinishReason)
		}
		return scanMessage(b, i, &c.Message)
	})
}

func scanMessage(b []byte, i int, m *leanMessage) (int, bool) {
	return jsonscan.Object(b, i, messageKeys, func(k int, b []byte, i int) (int, bool) {
		switch k {
		case 0:
			return jsonscan.String(b, i, &m.Role)
		case 1:
			return optionalString(b, i, &m.Content)
		case 2:
			return optionalString(b, i, &m.Refusal)
		case 3:
			if b[i] == 'n' {
				return i + 4, true
			}
			m.Audio = new(leanAudio)
			return jsonscan.Members(b, i, audioKeys, func(_ int, b []byte, i int) (int, bool) {
				return jsonscan.String(b, i, &m.Audio.ID)
			})
		case 4:
			if b[i] == 'n' {
				return i + 4, true
			}
			m.FunctionCall = new(functionCall)
			return scanFunction(b, i, m.FunctionCall)
		default:
			return scanToolCalls(b, i, &m.ToolCalls)
		}
	})
}

// optionalString reads a string, or null (no string), into *s.
func optionalString(b []byte, i int, s **string) (int, bool) {
	if b[i] == 'n' {
		*s = nil
		return i + 4, true
	}
	v := new(string)
	end, ok := jsonscan.String(b, i, v)
	*s = v
	return end, ok
}

func scanFunction(b []byte, i int, f *functionCall) (int, bool) {
	return jsonscan.Object(b, i, functionKeys, func(k int, b []byte, i int) (int, bool) {
		if k == 0 {
			return jsonscan.String(b, i, &f.Name)
		}
		return jsonscan.String(b, i, &f.Arguments)
	})
}

func scanToolCalls(b []byte, i int, out *[]leanToolCall) (int, bool) {
	calls := []leanToolCall{}
	end, null, ok := jsonscan.Array(b, i, func(i int) (int, bool) {
		calls = append(calls, leanToolCall{})
		tc := &calls[len(calls)-1]
		return jsonscan.Object(b, i, toolCallKeys, func(k int, b []byte, i int) (int, bool) {
			switch k {
			case 0:
				return jsonscan.String(b, i, &tc.ID)
			case 1:
				return jsonscan.String(b, i, &tc.Type)
			case 2:
				return scanFunction(b, i, &tc.Function)
			default:
				return jsonscan.Object(b, i, customKeys, func(k int, b []byte, i int) (int, bool) {
					if k == 0 {
						return jsonscan.String(b, i, &tc.Custom.Name)
					}
					return jsonscan.String(b, i, &tc.Custom.Input)
				})
			}
		})
	})
	if null {
		calls = nil
	}
	*out = calls
	return end, ok
}
