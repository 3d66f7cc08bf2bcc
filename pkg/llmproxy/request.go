package llmproxy

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"unicode/utf8"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/jsonscan"
)

// requestError is a client mistake in the request body; param names the
// offending field.
type requestError struct {
	param string
	code  string
	msg   string
}

func (e *requestError) Error() string { return e.msg }

// chatRequest is what the proxy needs from a chat-completions body. Spans
// point into the body, which is never modified, so nothing is copied.
type chatRequest struct {
	body     []byte
	members  []member
	model    member // value span zero when absent
	hasModel bool
	messages []byte
	stream   bool
	// requestedModel is the client's model string ("" when absent).
	requestedModel string
	// params are the raw values of the sampling parameters spans report
	// (nil when absent); they are only decoded when the call is traced.
	params [numParams][]byte
	// scratch backs members for typical bodies, saving an allocation.
	scratch [16]member
}

// Sampling parameters recorded on GenAI spans, indexes of chatRequest.params.
const (
	paramTemperature = iota
	paramTopP
	paramMaxTokens
	paramMaxCompletionTokens
	paramSeed
	paramFrequencyPenalty
	paramPresencePenalty
	paramN
	numParams
)

// paramKeys are the body keys of the sampling parameters, by index.
var paramKeys = [numParams]string{"temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "frequency_penalty", "presence_penalty", "n"}

// member is one top-level member of the body: [start, end) covers
// `"key" : value`, value starts at vstart.
type member struct {
	start, vstart, end int
	key                string
}

// invalidJSON is the error of a body that is not JSON; err is the
// decoder's, which says where the mistake is.
func invalidJSON(err error) *requestError {
	return &requestError{code: "invalid_json", msg: fmt.Sprintf("llmproxy: request body is not valid JSON: %v", err)}
}

// parse checks the body and locates the members the proxy reads or
// rewrites. It does not decode values it does not need, so numbers and
// everything else pass through byte for byte.
func (req *chatRequest) parse(body []byte) *requestError {
	if !json.Valid(body) {
		// Decode only to obtain a message with the offset of the mistake.
		var v any
		return invalidJSON(json.Unmarshal(body, &v))
	}
	i := jsonscan.SkipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return &requestError{code: "invalid_request_body", msg: "llmproxy: request body must be a JSON object"}
	}
	req.body = body
	members := req.scratch[:0]
	i = jsonscan.SkipSpace(body, i+1)
	for i < len(body) && body[i] != '}' {
		m := member{start: i}
		kEnd := jsonscan.SkipString(body, i)
		m.key = memberKey(body[i:kEnd])
		i = jsonscan.SkipSpace(body, kEnd)
		i = jsonscan.SkipSpace(body, i+1) // ':'
		m.vstart = i
		i = jsonscan.SkipValue(body, i)
		m.end = i
		members = append(members, m)
		i = jsonscan.SkipSpace(body, i)
		if i < len(body) && body[i] == ',' {
			i = jsonscan.SkipSpace(body, i+1)
		}
	}
	req.members = members
	// Later duplicates win, as in most JSON decoders the upstream may use.
	var messages []byte
	for _, m := range members {
		v := body[m.vstart:m.end]
		switch m.key {
		case "model":
			req.model, req.hasModel = m, true
		case "messages":
			messages = v
		case "stream":
			req.stream = string(v) == "true"
		case "":
		default:
			for i, k := range paramKeys {
				if m.key == k {
					req.params[i] = v
				}
			}
		}
	}
	if messages == nil {
		return &requestError{param: "messages", code: "missing_messages", msg: `llmproxy: request body has no "messages" array`}
	}
	if re := checkMessages(messages); re != nil {
		return re
	}
	req.messages = messages
	if req.hasModel {
		v := body[req.model.vstart:req.model.end]
		switch v[0] {
		case 'n': // null counts as absent
			req.hasModel = false
		case '"':
			req.requestedModel = decodeString(v)
		default:
			return &requestError{param: "model", code: "invalid_model", msg: "llmproxy: \"model\" must be a string"}
		}
	}
	return nil
}

// checkMessages requires a non-empty array of objects.
func checkMessages(v []byte) *requestError {
	if v[0] != '[' {
		return &requestError{param: "messages", code: "invalid_messages", msg: `llmproxy: "messages" must be an array of message objects`}
	}
	i := jsonscan.SkipSpace(v, 1)
	n := 0
	for i < len(v) && v[i] != ']' {
		if v[i] != '{' {
			return &requestError{param: fmt.Sprintf("messages[%d]", n), code: "invalid_messages",
				msg: fmt.Sprintf(`llmproxy: "messages[%d]" must be a JSON object`, n)}
		}
		i = jsonscan.SkipSpace(v, jsonscan.SkipValue(v, i))
		if i < len(v) && v[i] == ',' {
			i = jsonscan.SkipSpace(v, i+1)
		}
		n++
	}
	if n == 0 {
		return &requestError{param: "messages", code: "invalid_messages", msg: `llmproxy: "messages" must not be empty`}
	}
	return nil
}

// rewrite returns the body to send upstream and the model it names. The
// body is returned as is when nothing changes; otherwise members are copied
// verbatim in order, with "model" (and "rollout_id" when injected) replaced
// in place or appended.
func (req *chatRequest) rewrite(route Route, rolloutID string) (body []byte, model string) {
	model = req.requestedModel
	switch {
	case route.PinModel:
		model = cmp.Or(route.Model, osmo.PlaceholderModel)
	case (!req.hasModel || model == osmo.PlaceholderModel) && route.Model != "":
		model = route.Model
	case !req.hasModel:
		model = osmo.PlaceholderModel
	}
	setModel := !req.hasModel || model != req.requestedModel
	if !setModel && !route.InjectRolloutID {
		return req.body, model
	}
	out := make([]byte, 0, len(req.body)+len(model)+len(rolloutID)+32)
	out = append(out, '{')
	wroteModel, wroteRollout := false, false
	sep := func() {
		if len(out) > 1 {
			out = append(out, ',')
		}
	}
	for _, m := range req.members {
		switch {
		case setModel && m.key == "model":
			if !wroteModel {
				sep()
				out = appendJSONString(append(out, `"model":`...), model)
				wroteModel = true
			}
		case route.InjectRolloutID && m.key == "rollout_id":
			if !wroteRollout {
				sep()
				out = appendJSONString(append(out, `"rollout_id":`...), rolloutID)
				wroteRollout = true
			}
		default:
			sep()
			out = append(out, req.body[m.start:m.end]...)
		}
	}
	if setModel && !wroteModel {
		sep()
		out = appendJSONString(append(out, `"model":`...), model)
	}
	if route.InjectRolloutID && !wroteRollout {
		sep()
		out = appendJSONString(append(out, `"rollout_id":`...), rolloutID)
	}
	return append(out, '}'), model
}

// memberKey returns the key of a quoted JSON string; escaped keys are rare
// and take the slow path.
func memberKey(q []byte) string {
	inner := q[1 : len(q)-1]
	if bytes.IndexByte(inner, '\\') < 0 {
		// Compare against the keys the proxy cares about without allocating.
		switch string(inner) {
		case "model":
			return "model"
		case "messages":
			return "messages"
		case "stream":
			return "stream"
		case "rollout_id":
			return "rollout_id"
		}
		for _, k := range paramKeys {
			if string(inner) == k {
				return k
			}
		}
		return ""
	}
	return decodeString(q)
}

// decodeString decodes a quoted JSON string.
func decodeString(q []byte) string {
	inner := q[1 : len(q)-1]
	if bytes.IndexByte(inner, '\\') < 0 {
		return string(inner)
	}
	var s string
	_ = json.Unmarshal(q, &s) // q was validated
	return s
}

// appendJSONString appends s as a JSON string.
func appendJSONString(dst []byte, s string) []byte {
	if !utf8.ValidString(s) {
		b, _ := json.Marshal(s) // replaces invalid bytes with U+FFFD
		return append(dst, b...)
	}
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			dst = append(dst, '\\', c)
		case c < 0x20:
			dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			dst = append(dst, c)
		}
	}
	return append(dst, '"')
}
