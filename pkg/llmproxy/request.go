package llmproxy

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/osmo-rl/osmo"
)

// requestError is a client mistake in the request body; param names the
// offending field.
type requestError struct {
	param string
	code  string
	msg   string
}

func (e *requestError) Error() string { return e.msg }

// chatRequest is what the proxy needs from a chat-completions body.
type chatRequest struct {
	// members are the body's top-level members by their exact key, as a
	// policy server reads them; values are left as they came, so numbers and
	// everything else the proxy does not read pass through unchanged.
	members map[string]json.RawMessage
	// messages is the "messages" array as sent; messageList its elements,
	// each a JSON object, which the call's record keeps.
	messages    json.RawMessage
	messageList []json.RawMessage
	stream      bool
	// requestedModel is the client's model string; hasModel is false when
	// the body names none (or null).
	requestedModel string
	hasModel       bool
}

// invalidJSON is the error of a body that is not JSON; err is the
// decoder's, which says where the mistake is.
func invalidJSON(err error) *requestError {
	return &requestError{code: "invalid_json", msg: fmt.Sprintf("llmproxy: request body is not valid JSON: %v", err)}
}

// parse checks the body and reads the members the proxy needs.
func (req *chatRequest) parse(body []byte) *requestError {
	if err := json.Unmarshal(body, &req.members); err != nil || req.members == nil {
		// Unmarshal checks the whole body is JSON before it decodes: a
		// syntax error is the body's, any other that it is not an object.
		if _, ok := errors.AsType[*json.SyntaxError](err); ok {
			return invalidJSON(err)
		}
		return &requestError{code: "invalid_request_body", msg: "llmproxy: request body must be a JSON object"}
	}
	messages, ok := req.members["messages"]
	if !ok {
		return &requestError{param: "messages", code: "missing_messages", msg: `llmproxy: request body has no "messages" array`}
	}
	list, re := checkMessages(messages)
	if re != nil {
		return re
	}
	req.messages, req.messageList = messages, list
	_ = json.Unmarshal(req.members["stream"], &req.stream) // anything but true is no stream
	if v := req.members["model"]; !isNull(v) {
		if err := json.Unmarshal(v, &req.requestedModel); err != nil {
			return &requestError{param: "model", code: "invalid_model", msg: "llmproxy: \"model\" must be a string"}
		}
		req.hasModel = true
	}
	return nil
}

// checkMessages requires a non-empty array of objects, and returns its
// elements.
func checkMessages(v json.RawMessage) ([]json.RawMessage, *requestError) {
	var msgs []json.RawMessage
	if isNull(v) || json.Unmarshal(v, &msgs) != nil {
		return nil, &requestError{param: "messages", code: "invalid_messages", msg: `llmproxy: "messages" must be an array of message objects`}
	}
	if len(msgs) == 0 {
		return nil, &requestError{param: "messages", code: "invalid_messages", msg: `llmproxy: "messages" must not be empty`}
	}
	if i := slices.IndexFunc(msgs, func(m json.RawMessage) bool { return m[0] != '{' }); i >= 0 {
		return nil, &requestError{param: fmt.Sprintf("messages[%d]", i), code: "invalid_messages",
			msg: fmt.Sprintf(`llmproxy: "messages[%d]" must be a JSON object`, i)}
	}
	return msgs, nil
}

// rewrite returns the body to send upstream, the model it names and the
// token members it added (with ask; see askTokens): body, the one parsed,
// when nothing changes, else its members with "model" (and "rollout_id"
// when injected, and the token members) set. The request keeps no
// reference to body, so a call in flight holds it only when it goes
// upstream as it came.
func (req *chatRequest) rewrite(body []byte, route Route, rolloutID string, ask bool) ([]byte, string, []string) {
	model := req.requestedModel
	switch {
	case route.PinModel:
		model = cmp.Or(route.Model, osmo.PlaceholderModel)
	case (!req.hasModel || model == osmo.PlaceholderModel) && route.Model != "":
		model = route.Model
	case !req.hasModel:
		model = osmo.PlaceholderModel
	}
	var asked []string
	if ask {
		asked = req.askTokens()
	}
	setModel := !req.hasModel || model != req.requestedModel
	if !setModel && !route.InjectRolloutID && len(asked) == 0 {
		return body, model, nil
	}
	if setModel {
		req.members["model"] = jsonString(model)
	}
	if route.InjectRolloutID {
		req.members["rollout_id"] = jsonString(rolloutID)
	}
	return marshalMembers(req.members), model, asked
}

// marshalMembers encodes an object whose values are JSON already. HTML
// characters are left as they are: the policy reads JSON, not a page.
func marshalMembers(m map[string]json.RawMessage) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil {
		// The values were decoded from JSON or made by jsonString.
		panic("llmproxy: encoding a request body: " + err.Error())
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// jsonString is s as a JSON string.
func jsonString(s string) json.RawMessage {
	b, _ := json.Marshal(s) // a string always encodes
	return b
}
