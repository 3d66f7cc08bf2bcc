package mockllm

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// fixedEpoch anchors the "created" timestamps, which must not depend on the clock.
const fixedEpoch = 1735689600 // 2025-01-01T00:00:00Z

const maxTopLogprobs = 20

// chatRequest is the part of an OpenAI chat request the mock reads.
type chatRequest struct {
	Model         string            `json:"model"`
	Messages      []json.RawMessage `json:"messages"`
	Tools         []json.RawMessage `json:"tools"`
	Stream        bool              `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens           *int `json:"max_tokens"`
	MaxCompletionTokens *int `json:"max_completion_tokens"`
	Logprobs            bool `json:"logprobs"`
	TopLogprobs         *int `json:"top_logprobs"`
	// ReturnTokenIDs is vLLM's extension; OpenAI clients send it through
	// extra_body, which they flatten into the body, but accept it nested too.
	ReturnTokenIDs bool `json:"return_token_ids"`
	ExtraBody      *struct {
		ReturnTokenIDs bool `json:"return_token_ids"`
	} `json:"extra_body"`
	RolloutID json.RawMessage `json:"rollout_id"`
	// ToolChoice is "auto", "required", "none" or a named function.
	ToolChoice json.RawMessage `json:"tool_choice"`

	msgs   []map[string]any
	tools  []map[string]any
	choice toolChoice
	// offered is what tool_choice leaves the model to call.
	offered []map[string]any
}

// toolChoice is a parsed tool_choice; the zero value is "auto".
type toolChoice struct {
	none bool   // "none": answer without calling a tool
	name string // the one function the model may call
}

func (r *chatRequest) includeUsage() bool {
	return r.StreamOptions != nil && r.StreamOptions.IncludeUsage
}

func (r *chatRequest) wantTokenIDs() bool {
	return r.ReturnTokenIDs || r.ExtraBody != nil && r.ExtraBody.ReturnTokenIDs
}

// rolloutID is the body's rollout_id when it is a string.
func (r *chatRequest) rolloutID() string {
	var s string
	_ = json.Unmarshal(r.RolloutID, &s)
	return s
}

func badRequest(param, code, format string, args ...any) *apiError {
	return newAPIError(http.StatusBadRequest, "invalid_request_error", param, code, fmt.Sprintf(format, args...))
}

// parseRequest decodes and validates a chat request as a real server would.
func parseRequest(body []byte) (*chatRequest, *apiError) {
	var req chatRequest
	if err := json.Unmarshal(body, &req); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			if typeErr.Field == "" {
				return nil, badRequest("", "invalid_type", "request body must be a JSON object, got %s", typeErr.Value)
			}
			return nil, badRequest(typeErr.Field, "invalid_type", "invalid type for '%s': expected %s, got %s", typeErr.Field, typeErr.Type, typeErr.Value)
		}
		return nil, badRequest("", "invalid_json", "could not parse the JSON body of the request: %v", err)
	}
	if req.Messages == nil {
		return nil, badRequest("messages", "missing_required_parameter", "missing required parameter: 'messages'")
	}
	if len(req.Messages) == 0 {
		return nil, badRequest("messages", "empty_array", "'messages' must contain at least one message")
	}
	for i, raw := range req.Messages {
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil || m == nil {
			return nil, badRequest(fmt.Sprintf("messages[%d]", i), "invalid_type", "invalid type for 'messages[%d]': expected an object", i)
		}
		_, hasRole := m["role"].(string)
		_, hasType := m["type"].(string)
		if !hasRole && !hasType {
			return nil, badRequest(fmt.Sprintf("messages[%d].role", i), "missing_required_parameter", "missing required parameter: 'messages[%d].role'", i)
		}
		req.msgs = append(req.msgs, m)
	}
	for i, raw := range req.Tools {
		var t map[string]any
		if err := json.Unmarshal(raw, &t); err != nil || t == nil {
			return nil, badRequest(fmt.Sprintf("tools[%d]", i), "invalid_type", "invalid type for 'tools[%d]': expected an object", i)
		}
		req.tools = append(req.tools, t)
	}
	var apiErr *apiError
	if req.choice, req.offered, apiErr = parseToolChoice(req.ToolChoice, req.tools); apiErr != nil {
		return nil, apiErr
	}
	for name, v := range map[string]*int{"max_tokens": req.MaxTokens, "max_completion_tokens": req.MaxCompletionTokens} {
		if v != nil && *v < 1 {
			return nil, badRequest(name, "invalid_value", "'%s' must be at least 1, got %d", name, *v)
		}
	}
	if n := req.TopLogprobs; n != nil {
		if *n < 0 || *n > maxTopLogprobs {
			return nil, badRequest("top_logprobs", "invalid_value", "'top_logprobs' must be between 0 and %d, got %d", maxTopLogprobs, *n)
		}
		if *n > 0 && !req.Logprobs {
			return nil, badRequest("top_logprobs", "invalid_value", "'logprobs' must be true when 'top_logprobs' is set")
		}
	}
	return &req, nil
}

// parseToolChoice reads tool_choice as OpenAI defines it, and returns the
// tools it leaves the model to call. "required" is taken as "auto": the
// mock calls a tool whenever one helps, and a model forced to call one
// that cannot help has no right answer to imitate.
func parseToolChoice(raw json.RawMessage, tools []map[string]any) (toolChoice, []map[string]any, *apiError) {
	if len(raw) == 0 || string(raw) == "null" {
		return toolChoice{}, tools, nil
	}
	var mode string
	if json.Unmarshal(raw, &mode) == nil {
		switch mode {
		case "auto", "required":
			return toolChoice{}, tools, nil
		case "none":
			return toolChoice{none: true}, nil, nil
		}
		return toolChoice{}, nil, badRequest("tool_choice", "invalid_value", "invalid value for 'tool_choice': %q (want \"none\", \"auto\", \"required\" or a named function)", mode)
	}
	var named struct {
		Type     string `json:"type"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if err := json.Unmarshal(raw, &named); err != nil || named.Type != "function" || named.Function.Name == "" {
		return toolChoice{}, nil, badRequest("tool_choice", "invalid_value", "invalid value for 'tool_choice': want a string or {\"type\": \"function\", \"function\": {\"name\": ...}}")
	}
	for _, t := range tools {
		if fn, _ := t["function"].(map[string]any); fn["name"] == named.Function.Name {
			return toolChoice{name: named.Function.Name}, []map[string]any{t}, nil
		}
	}
	return toolChoice{}, nil, badRequest("tool_choice", "invalid_value", "invalid value for 'tool_choice': function %q is not in 'tools'", named.Function.Name)
}

// response is one assistant turn, ready to render as JSON or as chunks.
type response struct {
	id, model string
	created   int64
	content   string
	call      *toolCall
	finish    string
	pieces    []string // completion tokens; a call's name comes first
	nameLen   int      // how many pieces the call's name takes
	promptIDs []int
	withIDs   bool
	lps       []logprob // nil unless logprobs were asked
	// fingerprint is the system_fingerprint (empty: the mock's own).
	fingerprint string
}

// respond plays the assistant's turn for req. Ids are derived from what
// decides the answer (model, messages, tools, tool_choice), so the JSON and
// the streamed form of one request agree.
func respond(req *chatRequest) *response {
	key := []any{req.Model, req.msgs, req.tools}
	if req.choice != (toolChoice{}) {
		// Only a choice that narrows the tools changes the answer; leaving
		// it out otherwise keeps ids stable for requests without one.
		key = append(key, req.choice.none, req.choice.name)
	}
	canon, _ := json.Marshal(key)
	sum := sha256.Sum256(canon)
	h := hex.EncodeToString(sum[:])
	offset, _ := strconv.ParseUint(h[48:56], 16, 32)
	r := &response{
		id:        "chatcmpl-" + h[:24],
		model:     req.Model,
		created:   fixedEpoch + int64(offset%(365*24*3600)),
		promptIDs: promptTokenIDs(req.msgs, req.tools),
		withIDs:   req.wantTokenIDs(),
	}
	task, results := conversation(req.msgs)
	d := decide(task, results, toolsetOf(req.offered))
	if d.tool != "" {
		r.call = &toolCall{ID: "call_" + h[24:48], Type: "function", Function: functionCall{Name: d.tool, Arguments: d.args}}
		r.pieces = tokenize(d.tool)
		r.nameLen = len(r.pieces)
		r.pieces = append(r.pieces, tokenize(d.args)...)
		r.finish = "tool_calls"
	} else {
		r.content, r.pieces, r.finish = d.text, tokenize(d.text), "stop"
	}
	limit := cmp.Or(req.MaxCompletionTokens, req.MaxTokens)
	if limit != nil && len(r.pieces) > *limit {
		// Like a real server whose tool parser never saw a complete call:
		// what was generated comes back as text.
		r.pieces = r.pieces[:*limit]
		r.content, r.call, r.finish = strings.Join(r.pieces, ""), nil, "length"
	}
	if req.Logprobs {
		top := 0
		if req.TopLogprobs != nil {
			top = *req.TopLogprobs
		}
		r.lps = logprobs(r.pieces, top)
	}
	return r
}

type chatCompletion struct {
	ID                string   `json:"id"`
	Object            string   `json:"object"`
	Created           int64    `json:"created"`
	Model             string   `json:"model"`
	SystemFingerprint string   `json:"system_fingerprint"`
	Choices           []choice `json:"choices"`
	Usage             *usage   `json:"usage,omitempty"`
	PromptTokenIDs    []int    `json:"prompt_token_ids,omitempty"`
}

type choice struct {
	Index        int              `json:"index"`
	Message      *message         `json:"message,omitempty"`
	Delta        *delta           `json:"delta,omitempty"`
	Logprobs     *logprobsContent `json:"logprobs"`
	FinishReason *string          `json:"finish_reason"`
	TokenIDs     []int            `json:"token_ids,omitempty"`
}

type logprobsContent struct {
	Content []logprob `json:"content"`
}

type message struct {
	Role      string     `json:"role"`
	Content   *string    `json:"content"`
	ToolCalls []toolCall `json:"tool_calls,omitempty"`
}

type toolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function functionCall `json:"function"`
}

type functionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type delta struct {
	Role      string          `json:"role,omitempty"`
	Content   *string         `json:"content,omitempty"`
	ToolCalls []toolCallDelta `json:"tool_calls,omitempty"`
}

type toolCallDelta struct {
	Index    int    `json:"index"`
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name      string `json:"name,omitempty"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (r *response) usage() *usage {
	return &usage{PromptTokens: len(r.promptIDs), CompletionTokens: len(r.pieces), TotalTokens: len(r.promptIDs) + len(r.pieces)}
}

func (r *response) base(object string) chatCompletion {
	return chatCompletion{ID: r.id, Object: object, Created: r.created, Model: r.model, SystemFingerprint: cmp.Or(r.fingerprint, "fp_osmo_mock"), Choices: []choice{}}
}

// abort cuts the turn to its first n tokens, as text, ended by a pause's
// abort.
func (r *response) abort(n int) {
	n = min(n, len(r.pieces))
	r.pieces = r.pieces[:n]
	if r.lps != nil {
		r.lps = r.lps[:n]
	}
	r.content, r.call, r.nameLen, r.finish = strings.Join(r.pieces, ""), nil, 0, finishAbort
}

// abortChunk is the last chunk of a stream a pause aborted.
func (r *response) abortChunk() chatCompletion {
	out := r.base("chat.completion.chunk")
	reason := finishAbort
	out.Choices = []choice{{Delta: &delta{}, FinishReason: &reason}}
	return out
}

// choice carries the tokens pieces[from:to] (ids and logprobs, when asked).
func (r *response) choice(from, to int) choice {
	var c choice
	if r.withIDs && to > from {
		c.TokenIDs = tokenIDs(r.pieces[from:to])
	}
	if r.lps != nil && to > from {
		c.Logprobs = &logprobsContent{Content: r.lps[from:to]}
	}
	return c
}

// completion renders the turn as a chat.completion object.
func (r *response) completion() chatCompletion {
	out := r.base("chat.completion")
	c := r.choice(0, len(r.pieces))
	c.Message = &message{Role: "assistant"}
	if r.call != nil {
		c.Message.ToolCalls = []toolCall{*r.call}
	} else {
		c.Message.Content = &r.content
	}
	c.FinishReason = &r.finish
	out.Choices = []choice{c}
	out.Usage = r.usage()
	if r.withIDs {
		out.PromptTokenIDs = r.promptIDs
	}
	return out
}

// chunks renders the turn as chat.completion.chunk objects, one token each
// after the role chunk, then the finish chunk and, if asked, usage.
func (r *response) chunks(includeUsage bool) []chatCompletion {
	chunk := func(d *delta, from, to int) chatCompletion {
		out := r.base("chat.completion.chunk")
		c := r.choice(from, to)
		c.Delta = d
		out.Choices = []choice{c}
		return out
	}
	empty := ""
	first := chunk(&delta{Role: "assistant", Content: &empty}, 0, 0)
	if r.withIDs {
		first.PromptTokenIDs = r.promptIDs
	}
	out := []chatCompletion{first}
	if r.call != nil {
		head := toolCallDelta{ID: r.call.ID, Type: "function"}
		head.Function.Name = r.call.Function.Name
		out = append(out, chunk(&delta{ToolCalls: []toolCallDelta{head}}, 0, r.nameLen))
		for i := r.nameLen; i < len(r.pieces); i++ {
			var d toolCallDelta
			d.Function.Arguments = r.pieces[i]
			out = append(out, chunk(&delta{ToolCalls: []toolCallDelta{d}}, i, i+1))
		}
	} else {
		for i := range r.pieces {
			out = append(out, chunk(&delta{Content: &r.pieces[i]}, i, i+1))
		}
	}
	last := chunk(&delta{}, len(r.pieces), len(r.pieces))
	last.Choices[0].FinishReason = &r.finish
	out = append(out, last)
	if includeUsage {
		u := r.base("chat.completion.chunk")
		u.Usage = r.usage()
		out = append(out, u)
	}
	return out
}
