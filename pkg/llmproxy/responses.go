package llmproxy

import (
	"bytes"
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/osmo-rl/osmo"
)

// The Responses API (POST /v1/responses) is what the OpenAI Agents SDK and
// Strands Agents call by default. Policy servers (vLLM, SGLang, the training
// cluster's endpoint) serve chat completions, so the proxy translates: the
// request becomes a chat completion, which is routed, retried and recorded
// like any other, and its answer goes back to the client as a Response
// object or as Responses stream events.
//
// The proxy is stateless: a request must carry the whole conversation in
// "input". previous_response_id, conversation, background, stored prompts,
// item references and hosted tools need OpenAI's servers and are refused
// with a 400 naming the field.

// APIResponses is Call.API for calls made through the Responses API.
const APIResponses = "responses"

// responsesCall is the state of one Responses API call: what the answer
// echoes of the request, and the progress of a stream.
type responsesCall struct {
	// echo holds request members the Response object repeats.
	instructions, tools, toolChoice, temperature, topP, maxOutputTokens, parallelToolCalls, user json.RawMessage

	createdAt int64
	id        string // resp_…, fixed when the first upstream answer arrives

	// Stream progress: the next sequence number and output index, and the
	// output index of the reasoning item while it is open and of the
	// message once it opened (-1 otherwise).
	seq            int
	nextIndex      int
	reasoningIndex int
	messageIndex   int
	reasoningText  strings.Builder
	messageText    strings.Builder
	ended          bool
}

// responsesError is a Responses request the proxy cannot serve.
func responsesError(param, code, format string, args ...any) *requestError {
	return &requestError{param: param, code: code, msg: "llmproxy: " + fmt.Sprintf(format, args...)}
}

// droppedResponsesKeys are Responses request members with no chat
// completions counterpart that do not change what the policy generates;
// they are left out of the upstream request.
var droppedResponsesKeys = map[string]bool{
	"include": true, "store": true, "truncation": true, "metadata": true, "service_tier": true,
	"prompt_cache_key": true, "prompt_cache_retention": true, "prompt_cache_options": true,
	"safety_identifier": true, "context_management": true, "stream_options": true, "top_logprobs": true,
	"max_tool_calls": true,
}

// translatedResponsesKeys are the Responses request members that
// translateResponsesRequest translates (or refuses) rather than passes on.
var translatedResponsesKeys = map[string]bool{
	"input": true, "instructions": true, "tools": true, "tool_choice": true, "parallel_tool_calls": true,
	"max_output_tokens": true, "text": true, "reasoning": true, "stream": true,
	"previous_response_id": true, "conversation": true, "prompt": true, "background": true,
}

// translateResponsesRequest turns a Responses API request body into a chat
// completions request body.
func translateResponsesRequest(body []byte) ([]byte, *responsesCall, *requestError) {
	var in map[string]json.RawMessage
	if err := json.Unmarshal(body, &in); err != nil {
		// Unmarshal checks the whole body is JSON before it decodes: a
		// syntax error is the body's, any other that it is not an object.
		if _, ok := errors.AsType[*json.SyntaxError](err); ok {
			return nil, nil, invalidJSON(err)
		}
		return nil, nil, &requestError{code: "invalid_request_body", msg: "llmproxy: request body must be a JSON object"}
	}
	rc := &responsesCall{createdAt: time.Now().Unix(), reasoningIndex: -1, messageIndex: -1}
	out := make(map[string]json.RawMessage, len(in)+2)
	present := func(k string) (json.RawMessage, bool) {
		v, ok := in[k]
		return v, ok && !isNull(v)
	}

	for _, k := range []string{"previous_response_id", "conversation", "prompt"} {
		if v, ok := present(k); ok && string(v) != `""` {
			return nil, nil, responsesError(k, "unsupported_parameter",
				"%q needs state kept by OpenAI; the proxy is stateless: send the whole conversation in \"input\"", k)
		}
	}
	if v, ok := present("background"); ok && string(v) == "true" {
		return nil, nil, responsesError("background", "unsupported_parameter", `"background" responses are not supported; call synchronously or with "stream": true`)
	}

	msgs, re := responsesMessages(in["instructions"], in["input"])
	if re != nil {
		return nil, nil, re
	}
	out["messages"] = msgs

	var hasTools bool
	if v, ok := present("tools"); ok {
		tools, n, re := responsesTools(v)
		if re != nil {
			return nil, nil, re
		}
		if n > 0 {
			out["tools"], hasTools = tools, true
		}
		rc.tools = v
	}
	if v, ok := present("tool_choice"); ok {
		tc, re := responsesToolChoice(v)
		if re != nil {
			return nil, nil, re
		}
		if hasTools {
			out["tool_choice"] = tc
		}
		rc.toolChoice = v
	}
	if v, ok := present("parallel_tool_calls"); ok {
		// Chat servers refuse parallel_tool_calls without tools.
		if hasTools {
			out["parallel_tool_calls"] = v
		}
		rc.parallelToolCalls = v
	}
	if v, ok := present("max_output_tokens"); ok {
		out["max_tokens"] = v
		rc.maxOutputTokens = v
	}
	if v, ok := present("text"); ok {
		rf, re := responsesTextFormat(v)
		if re != nil {
			return nil, nil, re
		}
		if rf != nil {
			out["response_format"] = rf
		}
	}
	if v, ok := present("reasoning"); ok {
		var r struct {
			Effort *string `json:"effort"`
		}
		if err := json.Unmarshal(v, &r); err != nil {
			return nil, nil, responsesError("reasoning", "invalid_type", `"reasoning" must be an object: %v`, err)
		}
		if r.Effort != nil && *r.Effort != "" {
			out["reasoning_effort"] = mustJSON(*r.Effort)
		}
	}
	if v, ok := present("stream"); ok {
		if string(v) != "true" && string(v) != "false" {
			return nil, nil, responsesError("stream", "invalid_type", `"stream" must be a boolean`)
		}
		if string(v) == "true" {
			out["stream"] = v
			// The closing response.completed event reports usage.
			out["stream_options"] = json.RawMessage(`{"include_usage":true}`)
		}
	}
	rc.instructions = in["instructions"]
	rc.temperature, _ = present("temperature")
	rc.topP, _ = present("top_p")
	rc.user, _ = present("user")

	// Everything else (model, temperature, top_p, user, and server
	// extensions such as vLLM's return_token_ids) passes through as is.
	for k, v := range in {
		if translatedResponsesKeys[k] || droppedResponsesKeys[k] || isNull(v) {
			continue
		}
		out[k] = v
	}
	chat, err := json.Marshal(out)
	if err != nil {
		return nil, nil, &requestError{code: "invalid_request_body", msg: "llmproxy: translating the request: " + err.Error()}
	}
	return chat, rc, nil
}

// responsesMessages builds the chat messages of instructions and input.
func responsesMessages(instructions, input json.RawMessage) (json.RawMessage, *requestError) {
	var msgs []map[string]any
	if len(instructions) > 0 && !isNull(instructions) {
		var s string
		if err := json.Unmarshal(instructions, &s); err != nil {
			return nil, responsesError("instructions", "invalid_type", `"instructions" must be a string`)
		}
		if s != "" {
			msgs = append(msgs, map[string]any{"role": "system", "content": s})
		}
	}
	if len(input) == 0 || isNull(input) {
		return nil, responsesError("input", "missing_input", `request body has no "input"`)
	}
	var text string
	if err := json.Unmarshal(input, &text); err == nil {
		msgs = append(msgs, map[string]any{"role": "user", "content": text})
		return mustJSON(msgs), nil
	}
	var items []map[string]json.RawMessage
	if err := json.Unmarshal(input, &items); err != nil {
		return nil, responsesError("input", "invalid_type", `"input" must be a string or an array of input items`)
	}
	// lastAssistant is the assistant message function calls attach to: the
	// one just before them, if nothing came between.
	lastAssistant := -1
	for i, it := range items {
		param := fmt.Sprintf("input[%d]", i)
		typ := stringMember(it, "type")
		switch typ {
		case "", "message":
			role := stringMember(it, "role")
			m, re := responsesMessage(param, role, it["content"])
			if re != nil {
				return nil, re
			}
			msgs = append(msgs, m)
			lastAssistant = -1
			if role == "assistant" {
				lastAssistant = len(msgs) - 1
			}
		case "function_call":
			callID, name := stringMember(it, "call_id"), stringMember(it, "name")
			if callID == "" || name == "" {
				return nil, responsesError(param, "invalid_input_item", `%s: a function_call needs "call_id" and "name"`, param)
			}
			args := stringMember(it, "arguments")
			call := map[string]any{"id": callID, "type": "function", "function": map[string]any{"name": name, "arguments": args}}
			if lastAssistant < 0 {
				msgs = append(msgs, map[string]any{"role": "assistant", "content": nil})
				lastAssistant = len(msgs) - 1
			}
			calls, _ := msgs[lastAssistant]["tool_calls"].([]any)
			msgs[lastAssistant]["tool_calls"] = append(calls, call)
		case "function_call_output":
			callID := stringMember(it, "call_id")
			if callID == "" {
				return nil, responsesError(param+".call_id", "invalid_input_item", `%s: a function_call_output needs "call_id"`, param)
			}
			out, re := responsesText(param+".output", it["output"], "input_text", "output_text", "text")
			if re != nil {
				return nil, re
			}
			msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": callID, "content": out})
			lastAssistant = -1
		case "reasoning":
			// Chat completions take no reasoning input; the policy's chat
			// template decides what earlier reasoning it sees.
		case "item_reference":
			return nil, responsesError(param+".type", "unsupported_input_item", "%s: item references need items stored by OpenAI; send the items themselves", param)
		default:
			return nil, responsesError(param+".type", "unsupported_input_item",
				"%s: input items of type %q are not supported (the policy serves chat completions: messages, function_call and function_call_output items are)", param, typ)
		}
	}
	if len(msgs) == 0 {
		return nil, responsesError("input", "missing_input", `"input" holds no messages`)
	}
	return mustJSON(msgs), nil
}

// responsesMessage translates one message item.
func responsesMessage(param, role string, content json.RawMessage) (map[string]any, *requestError) {
	switch role {
	case "user", "system":
	case "developer":
		// Many policy chat templates know only system, user, assistant and tool.
		role = "system"
	case "assistant":
		text, re := responsesText(param+".content", content, "output_text", "input_text", "text")
		if re != nil {
			// A refusal is the only other assistant content part.
			refusal, re2 := responsesParts(param+".content", content, "refusal")
			if re2 != nil {
				return nil, re
			}
			return map[string]any{"role": "assistant", "content": nil, "refusal": refusal}, nil
		}
		return map[string]any{"role": "assistant", "content": text}, nil
	default:
		return nil, responsesError(param+".role", "invalid_role", `%s: "role" must be user, system, developer or assistant, got %q`, param, role)
	}
	if len(content) == 0 || isNull(content) {
		return nil, responsesError(param+".content", "missing_content", `%s has no "content"`, param)
	}
	var s string
	if err := json.Unmarshal(content, &s); err == nil {
		return map[string]any{"role": role, "content": s}, nil
	}
	var parts []map[string]json.RawMessage
	if err := json.Unmarshal(content, &parts); err != nil {
		return nil, responsesError(param+".content", "invalid_type", `%s.content must be a string or an array of content parts`, param)
	}
	out := make([]map[string]any, 0, len(parts))
	allText := true
	for j, p := range parts {
		pp := fmt.Sprintf("%s.content[%d]", param, j)
		switch typ := stringMember(p, "type"); typ {
		case "input_text", "output_text", "text":
			out = append(out, map[string]any{"type": "text", "text": stringMember(p, "text")})
		case "input_image":
			url := stringMember(p, "image_url")
			if url == "" {
				return nil, responsesError(pp+".image_url", "unsupported_content", `%s: images must be given by "image_url" (file ids need OpenAI's file store)`, pp)
			}
			img := map[string]any{"url": url}
			if d := stringMember(p, "detail"); d != "" {
				img["detail"] = d
			}
			out = append(out, map[string]any{"type": "image_url", "image_url": img})
			allText = false
		case "input_file":
			file := map[string]any{}
			for _, k := range []string{"file_data", "file_id", "filename"} {
				if v := stringMember(p, k); v != "" {
					file[k] = v
				}
			}
			out = append(out, map[string]any{"type": "file", "file": file})
			allText = false
		default:
			return nil, responsesError(pp+".type", "unsupported_content", "%s: content parts of type %q are not supported", pp, typ)
		}
	}
	if allText {
		// A plain string suits every chat template.
		var b strings.Builder
		for i, p := range out {
			if i > 0 {
				b.WriteByte('\n')
			}
			b.WriteString(p["text"].(string))
		}
		return map[string]any{"role": role, "content": b.String()}, nil
	}
	return map[string]any{"role": role, "content": out}, nil
}

// responsesText reads content that must be text: a string, or an array of
// parts of the given types, joined by newlines.
func responsesText(param string, content json.RawMessage, types ...string) (string, *requestError) {
	if len(content) == 0 || isNull(content) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(content, &s); err == nil {
		return s, nil
	}
	return responsesParts(param, content, types...)
}

func responsesParts(param string, content json.RawMessage, types ...string) (string, *requestError) {
	var parts []map[string]json.RawMessage
	if err := json.Unmarshal(content, &parts); err != nil {
		return "", responsesError(param, "invalid_type", "%s must be a string or an array of text parts", param)
	}
	var b strings.Builder
	for j, p := range parts {
		typ := stringMember(p, "type")
		ok := false
		for _, t := range types {
			ok = ok || typ == t
		}
		if !ok {
			return "", responsesError(fmt.Sprintf("%s[%d].type", param, j), "unsupported_content",
				"%s[%d]: content parts of type %q are not supported here", param, j, typ)
		}
		if j > 0 {
			b.WriteByte('\n')
		}
		key := "text"
		if typ == "refusal" {
			key = "refusal"
		}
		b.WriteString(stringMember(p, key))
	}
	return b.String(), nil
}

// responsesTools translates function tools; hosted tools run on OpenAI's
// servers and cannot be offered to a policy.
func responsesTools(v json.RawMessage) (json.RawMessage, int, *requestError) {
	var tools []map[string]json.RawMessage
	if err := json.Unmarshal(v, &tools); err != nil {
		return nil, 0, responsesError("tools", "invalid_type", `"tools" must be an array`)
	}
	out := make([]map[string]any, 0, len(tools))
	for i, t := range tools {
		param := fmt.Sprintf("tools[%d]", i)
		if typ := stringMember(t, "type"); typ != "function" {
			return nil, 0, responsesError(param+".type", "unsupported_tool",
				"%s: tools of type %q run on OpenAI's servers and are not available through the proxy; offer function tools", param, typ)
		}
		name := stringMember(t, "name")
		if name == "" {
			return nil, 0, responsesError(param+".name", "invalid_tool", `%s: a function tool needs a "name"`, param)
		}
		fn := map[string]any{"name": name}
		for _, k := range []string{"description", "parameters", "strict"} {
			if raw, ok := t[k]; ok && !isNull(raw) {
				fn[k] = raw
			}
		}
		out = append(out, map[string]any{"type": "function", "function": fn})
	}
	return mustJSON(out), len(out), nil
}

func responsesToolChoice(v json.RawMessage) (json.RawMessage, *requestError) {
	var s string
	if err := json.Unmarshal(v, &s); err == nil {
		switch s {
		case "auto", "none", "required":
			return v, nil
		}
		return nil, responsesError("tool_choice", "invalid_value", `"tool_choice" must be auto, none, required or a function, got %q`, s)
	}
	var o map[string]json.RawMessage
	if err := json.Unmarshal(v, &o); err != nil {
		return nil, responsesError("tool_choice", "invalid_type", `"tool_choice" must be a string or an object`)
	}
	if typ := stringMember(o, "type"); typ != "function" {
		return nil, responsesError("tool_choice.type", "unsupported_tool_choice", `"tool_choice" of type %q is not supported; use auto, none, required or a function`, typ)
	}
	name := stringMember(o, "name")
	if name == "" {
		return nil, responsesError("tool_choice.name", "invalid_value", `"tool_choice" names no function`)
	}
	return mustJSON(map[string]any{"type": "function", "function": map[string]any{"name": name}}), nil
}

// responsesTextFormat maps text.format to a chat response_format (nil for
// plain text).
func responsesTextFormat(v json.RawMessage) (json.RawMessage, *requestError) {
	var t struct {
		Format map[string]json.RawMessage `json:"format"`
	}
	if err := json.Unmarshal(v, &t); err != nil {
		return nil, responsesError("text", "invalid_type", `"text" must be an object`)
	}
	switch typ := stringMember(t.Format, "type"); typ {
	case "", "text":
		return nil, nil
	case "json_object":
		return json.RawMessage(`{"type":"json_object"}`), nil
	case "json_schema":
		schema := map[string]json.RawMessage{}
		for k, raw := range t.Format {
			if k != "type" {
				schema[k] = raw
			}
		}
		return mustJSON(map[string]any{"type": "json_schema", "json_schema": schema}), nil
	default:
		return nil, responsesError("text.format.type", "invalid_value", `"text.format.type" must be text, json_object or json_schema, got %q`, typ)
	}
}

// The answer.

// responseItem is one output item of a Response.
type responseItem struct {
	Type    string         `json:"type"`
	ID      string         `json:"id"`
	Status  string         `json:"status,omitempty"`
	Role    string         `json:"role,omitempty"`
	Content []responsePart `json:"content,omitempty"`
	// Reasoning items always carry a summary, possibly empty.
	Summary   *[]responsePart `json:"summary,omitempty"`
	CallID    string          `json:"call_id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Arguments *string         `json:"arguments,omitempty"`
}

type responsePart struct {
	Type        string    `json:"type"`
	Text        *string   `json:"text,omitempty"`
	Refusal     string    `json:"refusal,omitempty"`
	Annotations *[]string `json:"annotations,omitempty"`
	Logprobs    *[]string `json:"logprobs,omitempty"`
}

// assistantTurn is a chat assistant message, as recorded.
type assistantTurn struct {
	Content          json.RawMessage `json:"content"`
	ReasoningContent string          `json:"reasoning_content"`
	Reasoning        string          `json:"reasoning"`
	Refusal          string          `json:"refusal"`
	ToolCalls        []struct {
		ID       string `json:"id"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

func (t *assistantTurn) text() string {
	var s string
	if json.Unmarshal(t.Content, &s) == nil {
		return s
	}
	// Content parts: join their text.
	var parts []struct {
		Text string `json:"text"`
	}
	_ = json.Unmarshal(t.Content, &parts)
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(p.Text)
	}
	return b.String()
}

func (t *assistantTurn) reasoning() string {
	if t.ReasoningContent != "" {
		return t.ReasoningContent
	}
	return t.Reasoning
}

// setID fixes the Response id from the upstream completion id.
func (rc *responsesCall) setID(chatID string) {
	if rc.id != "" {
		return
	}
	base := strings.TrimPrefix(chatID, "chatcmpl-")
	if base == "" || !validHeaderValue(base) {
		var b [12]byte
		_, _ = rand.Read(b[:])
		base = hex.EncodeToString(b[:])
	}
	rc.id = "resp_" + base
}

func (rc *responsesCall) itemID(prefix string) string {
	return prefix + strings.TrimPrefix(rc.id, "resp_")
}

// turnOf is the assistant message a finished call recorded.
func turnOf(c *osmo.LLMCall) assistantTurn {
	var turn assistantTurn
	_ = json.Unmarshal(c.ResponseMessage, &turn)
	return turn
}

// outputItems builds the output of a finished call from its turn:
// reasoning, then the message, then the function calls, the order in which
// a stream opens them.
func (rc *responsesCall) outputItems(turn assistantTurn) []responseItem {
	items := []responseItem{}
	if r := turn.reasoning(); r != "" {
		items = append(items, reasoningItem(rc.itemID("rs_"), "completed", r))
	}
	if text := turn.text(); text != "" || turn.Refusal != "" {
		msg := responseItem{Type: "message", ID: rc.itemID("msg_"), Status: "completed", Role: "assistant"}
		if text != "" {
			msg.Content = append(msg.Content, outputText(text))
		}
		if turn.Refusal != "" {
			msg.Content = append(msg.Content, responsePart{Type: "refusal", Refusal: turn.Refusal})
		}
		items = append(items, msg)
	}
	for i, tc := range turn.ToolCalls {
		items = append(items, functionCallItem(rc.functionCallID(tc.ID, i), tc.ID, tc.Function.Name, tc.Function.Arguments, "completed"))
	}
	return items
}

func (rc *responsesCall) functionCallID(callID string, i int) string {
	if callID != "" && validHeaderValue(callID) {
		return "fc_" + callID
	}
	return rc.itemID("fc_") + "_" + strconv.Itoa(i)
}

func outputText(text string) responsePart {
	return responsePart{Type: "output_text", Text: &text, Annotations: &[]string{}, Logprobs: &[]string{}}
}

func reasoningItem(id, status, text string) responseItem {
	item := responseItem{Type: "reasoning", ID: id, Status: status, Summary: &[]responsePart{}}
	if text != "" || status == "completed" {
		item.Content = []responsePart{{Type: "reasoning_text", Text: &text}}
	}
	return item
}

func functionCallItem(id, callID, name, args, status string) responseItem {
	return responseItem{Type: "function_call", ID: id, Status: status, CallID: callID, Name: name, Arguments: &args}
}

// response builds the Response object with output (nil: none). c is nil
// for the in-progress object that opens a stream.
func (rc *responsesCall) response(c *osmo.LLMCall, status string, output []responseItem) map[string]any {
	r := map[string]any{
		"id": rc.id, "object": "response", "created_at": rc.createdAt, "status": status,
		"error": nil, "incomplete_details": nil,
		"instructions": rawOrNil(rc.instructions), "max_output_tokens": rawOrNil(rc.maxOutputTokens),
		"model": "", "output": []responseItem{},
		"parallel_tool_calls": true, "previous_response_id": nil,
		"reasoning":   map[string]any{"effort": nil, "summary": nil},
		"store":       false,
		"temperature": rawOrNil(rc.temperature), "top_p": rawOrNil(rc.topP),
		"text":        map[string]any{"format": map[string]any{"type": "text"}},
		"tool_choice": "auto", "tools": []any{}, "truncation": "disabled",
		"user": rawOrNil(rc.user), "metadata": map[string]any{}, "usage": nil,
	}
	if len(rc.tools) > 0 {
		r["tools"] = rc.tools
	}
	if len(rc.toolChoice) > 0 {
		r["tool_choice"] = rc.toolChoice
	}
	if len(rc.parallelToolCalls) > 0 {
		r["parallel_tool_calls"] = rc.parallelToolCalls
	}
	if output != nil {
		r["output"] = output
	}
	if c == nil {
		return r
	}
	r["model"] = c.Model
	u := c.Usage
	r["usage"] = map[string]any{
		"input_tokens":          u.PromptTokens,
		"input_tokens_details":  map[string]any{"cached_tokens": u.CachedTokens},
		"output_tokens":         u.CompletionTokens,
		"output_tokens_details": map[string]any{"reasoning_tokens": 0},
		"total_tokens":          cmp.Or(u.TotalTokens, u.PromptTokens+u.CompletionTokens),
	}
	switch c.FinishReason {
	case "length":
		r["status"] = "incomplete"
		r["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
	case "content_filter":
		r["status"] = "incomplete"
		r["incomplete_details"] = map[string]any{"reason": "content_filter"}
	}
	return r
}

// complete is the Response object of a finished non-stream call.
func (rc *responsesCall) complete(c *osmo.LLMCall) []byte {
	rc.setID(c.ID)
	return mustJSON(rc.response(c, "completed", rc.outputItems(turnOf(c))))
}

// Stream events. Text and reasoning are streamed as they arrive; function
// calls are sent whole once the upstream has finished the turn (their
// arguments arrive in pieces that clients only use once complete).

// streamStart appends the events that open a stream.
func (rc *responsesCall) streamStart(dst []byte, chatID string) []byte {
	rc.setID(chatID)
	r := rc.response(nil, "in_progress", nil)
	dst = rc.appendEvent(dst, "response.created", map[string]any{"response": r})
	return rc.appendEvent(dst, "response.in_progress", map[string]any{"response": r})
}

// streamDelta appends the events of one upstream chunk's deltas.
func (rc *responsesCall) streamDelta(dst []byte, d chunkDelta) []byte {
	if d.reasoning != "" && rc.messageIndex < 0 {
		if rc.reasoningIndex < 0 {
			rc.reasoningIndex = rc.nextIndex
			rc.nextIndex++
			dst = rc.appendEvent(dst, "response.output_item.added", map[string]any{
				"output_index": rc.reasoningIndex, "item": reasoningItem(rc.itemID("rs_"), "in_progress", ""),
			})
		}
		rc.reasoningText.WriteString(d.reasoning)
		dst = rc.appendEvent(dst, "response.reasoning_text.delta", map[string]any{
			"item_id": rc.itemID("rs_"), "output_index": rc.reasoningIndex, "content_index": 0, "delta": d.reasoning,
		})
	}
	if d.content != "" {
		dst = rc.closeReasoning(dst)
		if rc.messageIndex < 0 {
			rc.messageIndex = rc.nextIndex
			rc.nextIndex++
			dst = rc.appendEvent(dst, "response.output_item.added", map[string]any{
				"output_index": rc.messageIndex,
				"item":         responseItem{Type: "message", ID: rc.itemID("msg_"), Status: "in_progress", Role: "assistant", Content: []responsePart{}},
			})
			empty := outputText("")
			dst = rc.appendEvent(dst, "response.content_part.added", map[string]any{
				"item_id": rc.itemID("msg_"), "output_index": rc.messageIndex, "content_index": 0, "part": empty,
			})
		}
		rc.messageText.WriteString(d.content)
		dst = rc.appendEvent(dst, "response.output_text.delta", map[string]any{
			"item_id": rc.itemID("msg_"), "output_index": rc.messageIndex, "content_index": 0, "delta": d.content, "logprobs": []any{},
		})
	}
	return dst
}

func (rc *responsesCall) closeReasoning(dst []byte) []byte {
	if rc.reasoningIndex < 0 {
		return dst
	}
	text := rc.reasoningText.String()
	dst = rc.appendEvent(dst, "response.reasoning_text.done", map[string]any{
		"item_id": rc.itemID("rs_"), "output_index": rc.reasoningIndex, "content_index": 0, "text": text,
	})
	dst = rc.appendEvent(dst, "response.output_item.done", map[string]any{
		"output_index": rc.reasoningIndex, "item": reasoningItem(rc.itemID("rs_"), "completed", text),
	})
	rc.reasoningIndex = -1 // closed; reasoning after the message is only in the final object
	return dst
}

// streamEnd appends the events that close a finished stream: the open
// items, the function calls, and response.completed (or .incomplete).
func (rc *responsesCall) streamEnd(dst []byte, c *osmo.LLMCall) []byte {
	if rc.ended {
		return dst
	}
	rc.ended = true
	dst = rc.closeReasoning(dst)
	if rc.messageIndex >= 0 {
		text := rc.messageText.String()
		part := outputText(text)
		dst = rc.appendEvent(dst, "response.output_text.done", map[string]any{
			"item_id": rc.itemID("msg_"), "output_index": rc.messageIndex, "content_index": 0, "text": text, "logprobs": []any{},
		})
		dst = rc.appendEvent(dst, "response.content_part.done", map[string]any{
			"item_id": rc.itemID("msg_"), "output_index": rc.messageIndex, "content_index": 0, "part": part,
		})
		dst = rc.appendEvent(dst, "response.output_item.done", map[string]any{
			"output_index": rc.messageIndex,
			"item":         responseItem{Type: "message", ID: rc.itemID("msg_"), Status: "completed", Role: "assistant", Content: []responsePart{part}},
		})
	}
	turn := turnOf(c)
	for i, tc := range turn.ToolCalls {
		id := rc.functionCallID(tc.ID, i)
		idx := rc.nextIndex
		rc.nextIndex++
		dst = rc.appendEvent(dst, "response.output_item.added", map[string]any{
			"output_index": idx, "item": functionCallItem(id, tc.ID, tc.Function.Name, "", "in_progress"),
		})
		dst = rc.appendEvent(dst, "response.function_call_arguments.delta", map[string]any{
			"item_id": id, "output_index": idx, "delta": tc.Function.Arguments,
		})
		dst = rc.appendEvent(dst, "response.function_call_arguments.done", map[string]any{
			"item_id": id, "output_index": idx, "name": tc.Function.Name, "arguments": tc.Function.Arguments,
		})
		dst = rc.appendEvent(dst, "response.output_item.done", map[string]any{
			"output_index": idx, "item": functionCallItem(id, tc.ID, tc.Function.Name, tc.Function.Arguments, "completed"),
		})
	}
	r := rc.response(c, "completed", rc.outputItems(turn))
	typ := "response.completed"
	if r["status"] == "incomplete" {
		typ = "response.incomplete"
	}
	return rc.appendEvent(dst, typ, map[string]any{"response": r})
}

// streamFail appends response.failed for a stream that broke after it
// started; the client learns why instead of seeing the stream stop.
func (rc *responsesCall) streamFail(dst []byte, c *osmo.LLMCall, code string) []byte {
	if rc.ended {
		return dst
	}
	rc.ended = true
	r := rc.response(c, "failed", nil)
	r["error"] = map[string]any{"code": code, "message": c.Error}
	return rc.appendEvent(dst, "response.failed", map[string]any{"response": r})
}

// appendEvent appends one SSE event: "event: TYPE" and its data.
func (rc *responsesCall) appendEvent(dst []byte, typ string, fields map[string]any) []byte {
	fields["type"] = typ
	fields["sequence_number"] = rc.seq
	rc.seq++
	dst = append(dst, "event: "...)
	dst = append(dst, typ...)
	dst = append(dst, "\ndata: "...)
	dst = append(dst, mustJSON(fields)...)
	return append(dst, "\n\n"...)
}

// chunkDelta is what a stream chunk adds to choice 0's text.
type chunkDelta struct {
	content, reasoning string
}

func isNull(v json.RawMessage) bool {
	return len(v) == 0 || string(bytes.TrimSpace(v)) == "null"
}

func rawOrNil(v json.RawMessage) any {
	if isNull(v) {
		return nil
	}
	return v
}

// stringMember is o[k] as a string ("" when absent or not a string).
func stringMember(o map[string]json.RawMessage, k string) string {
	var s string
	if v, ok := o[k]; ok {
		_ = json.Unmarshal(v, &s)
	}
	return s
}

// mustJSON encodes values built here from decoded JSON, which cannot fail.
func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic("llmproxy: encoding a translated body: " + err.Error())
	}
	return b
}
