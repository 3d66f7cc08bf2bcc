package osmoopenai

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"
	"github.com/openai/openai-go/v3/shared/constant"

	"github.com/osmo-rl/osmo"
)

// direct posts a session's chat completions to its rollout's endpoint with
// the endpoint's own client: one request, one body, one response decode.
//
// A session's calls reach osmo's LLM proxy, usually in the same process,
// and openai-go's request machinery has nothing to do on that path (no
// retries: the proxy retries the policy; no environment, organization or
// project; no middleware) yet costs a request config, several copies of
// its dozen headers and a clone of the default transport per session:
// about 12 KiB live per call in flight (docs/performance.md).
// The body is the JSON value openai-go writes for the params (requestBody),
// the reply is decoded by openai-go's ChatCompletion, and an HTTP error
// comes back as the *openai.Error openai-go returns, so the two paths are
// one to the caller.
// A session made with request options goes through openai-go, which is
// where those options mean something.
type direct struct {
	client *http.Client
	url    string
	// header is what every request carries, keys canonical, the last of
	// a key winning; each request gets a map of its own (a transport may
	// add trace context to the one it is given).
	header []headerField
}

type headerField struct{ key, value string }

func newDirect(ep osmo.Endpoint, rolloutID, sampleID string) *direct {
	client := ep.HTTPClient
	if client == nil {
		client = http.DefaultClient
	}
	fields := make([]headerField, 0, len(ep.Headers)+5)
	set := func(k, v string) {
		k = http.CanonicalHeaderKey(k)
		for i := range fields {
			if fields[i].key == k {
				fields[i].value = v
				return
			}
		}
		fields = append(fields, headerField{k, v})
	}
	for k, v := range ep.Headers {
		set(k, v)
	}
	set("Content-Type", "application/json")
	set("Accept", "application/json")
	set("Authorization", "Bearer "+ep.APIKey)
	// Last: the ids this session is bound to win over anything above.
	set(headerRolloutID, rolloutID)
	set(headerSampleID, sampleID)
	return &direct{client: client, url: strings.TrimRight(ep.BaseURL, "/") + "/chat/completions", header: fields}
}

// complete posts params with items as its messages; enc, when not nil,
// is params encoded (see encodeParams). lean says which replies
// decodeLean reads (see Session.complete).
//
// A reply decodeLean read is in a kept completion, which turn holds, to be
// let go (done) once the turn no longer reads it.
func (d *direct) complete(ctx context.Context, params *openai.ChatCompletionNewParams, items []json.RawMessage, enc *encodedParams, lean leanReplies) (_ *openai.ChatCompletion, turn *leanCompletion, _ error) {
	body, err := requestBody(params, items, enc)
	if err != nil {
		return nil, nil, fmt.Errorf("encode request: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.url, bytes.NewReader(body))
	if err != nil {
		return nil, nil, err
	}
	req.Header = make(http.Header, len(d.header))
	for _, f := range d.header {
		req.Header[f.key] = []string{f.value}
	}
	res, err := d.client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	contents, err := readBody(res)
	_ = res.Body.Close()
	if err != nil {
		return nil, nil, fmt.Errorf("error reading response body: %w", err)
	}
	if res.StatusCode >= 400 {
		return nil, nil, apiError(req, res, contents)
	}
	if mt, _, _ := mime.ParseMediaType(res.Header.Get("Content-Type")); !strings.Contains(mt, "application/json") && !strings.HasSuffix(mt, "+json") {
		return nil, nil, fmt.Errorf("response is %q, not JSON: %s", res.Header.Get("Content-Type"), truncate(contents, 128))
	}
	if lean != leanNone {
		if t, ok := decodeLean(contents, lean == leanToolTurns); ok {
			return &t.c, t, nil
		}
	}
	out, err := decodeCompletion(contents)
	if err != nil {
		return nil, nil, fmt.Errorf("error parsing response json: %w", err)
	}
	return out, nil, nil
}

// leanReply is what decodeLean reads of a reply: its id, and its first
// choice's finish reason and message, as far as replyParam and toolCalls
// read them.
type leanReply struct {
	ID      string       `json:"id"`
	Choices []leanChoice `json:"choices"`
}

type leanChoice struct {
	FinishReason string      `json:"finish_reason"`
	Message      leanMessage `json:"message"`
}

type leanMessage struct {
	Role         string         `json:"role"`
	Content      *string        `json:"content"`
	Refusal      *string        `json:"refusal"`
	Audio        *leanAudio     `json:"audio"`
	FunctionCall *functionCall  `json:"function_call"`
	ToolCalls    []leanToolCall `json:"tool_calls"`
}

type leanAudio struct {
	ID string `json:"id"`
}

type leanToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function functionCall `json:"function"`
	Custom   customCall   `json:"custom"`
}

type customCall struct {
	Name  string `json:"name"`
	Input string `json:"input"`
}

// functionCall is a function's name and arguments, in a tool call or the
// legacy function_call.
type functionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// decodeLean decodes a reply into the completion openai-go would decode,
// as far as Run's turns and RunText read it: the first choice's finish
// reason and message (its text, refusal, audio id, legacy function call
// and tool calls), and the id. Nothing else is set, and nothing has its
// JSON metadata: it is for replies that are not returned as a completion
// (Run's turns before the last, every turn of RunText), which go no
// further than replyParam, toolCalls and the message's text. ok is false
// for a reply without tool calls when needTools, and for one this decoder
// does not read as openai-go would (a role other than the assistant's, a
// field of another type, text that is not UTF-8, which encoding/json
// replaces and openai-go keeps): decodeCompletion reads those.
//
// openai-go's decoder, which reads every field of the reply and keeps
// each field's JSON, was 5% of osmo serve's CPU running the multiply
// workflow, half of it on replies only read for their tool calls
// (docs/performance.md). A reply is read by scanReply, in one pass; one
// it leaves is decoded by encoding/json, on a goroutine of its own as
// openai-go's is (offStack), so the caller's stack stays as it is.
func decodeLean(contents []byte, needTools bool) (_ *leanCompletion, ok bool) {
	// A reply without the key asks for no tools (a final answer, which Run
	// returns as openai-go decodes it): not read twice. A key written with
	// escapes reads as a reply without it, which openai-go decodes too.
	if needTools && !bytes.Contains(contents, []byte(`"tool_calls"`)) {
		return nil, false
	}
	if !utf8.Valid(contents) {
		return nil, false
	}
	if !json.Valid(contents) {
		return nil, false
	}
	var r leanReply
	if !scanReply(contents, &r) {
		r = leanReply{}
		var err error
		err = json.Unmarshal(contents, &r)
		if err != nil {
			return nil, false
		}
	}
	if len(r.Choices) == 0 {
		return nil, false
	}
	m := &r.Choices[0].Message
	if (needTools && len(m.ToolCalls) == 0) || m.Role != "assistant" {
		return nil, false
	}
	t := leanCompletions.Get().(*leanCompletion)
	msg := &t.choice[0].Message
	msg.Role = constant.Assistant(m.Role)
	if m.Content != nil {
		msg.Content = *m.Content
	}
	if m.Refusal != nil {
		msg.Refusal = *m.Refusal
	}
	if m.Audio != nil {
		msg.Audio.ID = m.Audio.ID
	}
	if m.FunctionCall != nil {
		msg.FunctionCall.Name, msg.FunctionCall.Arguments = m.FunctionCall.Name, m.FunctionCall.Arguments
	}
	if len(m.ToolCalls) > 0 {
		msg.ToolCalls = make([]openai.ChatCompletionMessageToolCallUnion, len(m.ToolCalls))
	}
	for i, tc := range m.ToolCalls {
		u := &msg.ToolCalls[i]
		u.ID, u.Type = tc.ID, tc.Type
		u.Function.Name, u.Function.Arguments = tc.Function.Name, tc.Function.Arguments
		u.Custom.Name, u.Custom.Input = tc.Custom.Name, tc.Custom.Input
	}
	t.choice[0].FinishReason = r.Choices[0].FinishReason
	t.c.ID, t.c.Choices = r.ID, t.choice[:]
	return t, true
}

// leanCompletion is a completion as decodeLean fills it, with its one
// choice. A turn of Run reads it and lets it go (done) for the next
// turn's: an openai.ChatCompletion, its JSON metadata included, is over
// 2 KiB, allocated once per turn of every rollout.
type leanCompletion struct {
	c      openai.ChatCompletion
	choice [1]openai.ChatCompletionChoice
}

// leanCompletions are the turns' completions let go: a cache of values, as
// offStack's goroutines are one of goroutines.
var leanCompletions = sync.Pool{New: func() any { return new(leanCompletion) }}

// done lets t go for reuse, once nothing reads it; nil does nothing.
func (t *leanCompletion) done() {
	if t == nil {
		return
	}
	*t = leanCompletion{}
	leanCompletions.Put(t)
}

// leanReplies says which replies a call reads with decodeLean.
type leanReplies uint8

const (
	// leanNone: none; every reply is openai-go's (Complete, Run's last
	// turn: both return it).
	leanNone leanReplies = iota
	// leanToolTurns: a reply that asks for tools (Run's turns before its
	// last, which read such a reply for its tool calls and its message,
	// and return the next).
	leanToolTurns
	// leanAll: any reply decodeLean reads as openai-go would (RunText,
	// which returns none).
	leanAll
)

// decodeCompletion decodes a reply with openai-go, on a goroutine of its
// own (see offStack): openai-go's decoder needs over 12 KiB of stack.
func decodeCompletion(contents []byte) (*openai.ChatCompletion, error) {
	out := new(openai.ChatCompletion)
	var err error
	err = out.UnmarshalJSON(contents)
	return out, err
}

// requestBody is the request JSON of params with items as its messages:
// what openai-go writes for params whose Messages are items, as a JSON
// value (its keys may come in another order).
//
// The messages are the session's items, already the JSON objects they
// encode to, and are copied in as they are; the rest is enc, or params
// encoded now when enc is nil (Run encodes them once for all its turns).
// Through openai-go every item of the history was compacted again on every
// turn, and every tool schema (a map) encoded with its keys sorted: most of
// the cost of a call in a workflow (docs/performance.md). Params with extra
// fields, or made with param.Override, are encoded whole by openai-go,
// which is where those mean something.
func requestBody(params *openai.ChatCompletionNewParams, items []json.RawMessage, enc *encodedParams) ([]byte, error) {
	if !plain(params) {
		p := *params
		p.Messages = messageOverrides(items)
		return json.Marshal(&p)
	}
	if enc == nil {
		var err error
		if enc, err = encodeOnce(params, nil); err != nil {
			return nil, err
		}
	}
	rest, tools := enc.rest, enc.tools
	n := len(rest) + len(tools) + 32
	for _, it := range items {
		n += len(it) + 1
	}
	b := make([]byte, 0, n)
	b = append(b, `{"messages":[`...)
	for i, it := range items {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, it...)
	}
	b = append(b, ']')
	if tools != nil {
		b = append(b, `,"tools":`...)
		b = append(b, tools...)
	}
	// rest is an object: "{}", or "{" fields "}".
	if len(rest) > 2 {
		b = append(b, ',')
		b = append(b, rest[1:]...)
	} else {
		b = append(b, '}')
	}
	return b, nil
}

// encodedParams are params as they go on the wire, but for their messages.
type encodedParams struct {
	// tools is params.Tools as json.Marshal encodes them, nil when params
	// have none.
	tools []byte
	// rest is the other fields (messages and tools left out), an object.
	rest []byte
}

// encodeOnce is params encoded but for their messages, for requestBody
// (Run encodes them once for all its turns); nil for params encoded whole
// on every call (see plain). own are the tools of params.Tools that are
// Run's own (see writeParams).
func encodeOnce(params *openai.ChatCompletionNewParams, own []Tool) (*encodedParams, error) {
	if !plain(params) {
		return nil, nil
	}
	if enc := writeParams(params, own); enc != nil {
		return enc, nil
	}
	return encodeParams(params)
}

// encodeParams encodes params but for their messages, for requestBody,
// through openai-go: the params writeParams does not write. openai-go's
// encoder passes a ChatCompletionNewParams (1.2 KiB) by value at each
// level and needs about 10 KiB of stack for it: it runs off the caller's
// stack (offStack).
func encodeParams(params *openai.ChatCompletionNewParams) (enc *encodedParams, err error) {
	enc, err = encodeParamsHere(params)
	return enc, err
}

func encodeParamsHere(params *openai.ChatCompletionNewParams) (*encodedParams, error) {
	enc := &encodedParams{}
	msgs, offered := params.Messages, params.Tools
	params.Messages, params.Tools = nil, nil
	rest, err := json.Marshal(params)
	params.Messages, params.Tools = msgs, offered
	if err != nil {
		return nil, err
	}
	enc.rest = rest
	if offered != nil {
		if enc.tools, err = json.Marshal(offered); err != nil {
			return nil, err
		}
	}
	return enc, nil
}

// messageOverrides are items as message params that encode to exactly
// them.
func messageOverrides(items []json.RawMessage) []openai.ChatCompletionMessageParamUnion {
	msgs := make([]openai.ChatCompletionMessageParamUnion, len(items))
	for i, raw := range items {
		msgs[i] = param.Override[openai.ChatCompletionMessageParamUnion](raw)
	}
	return msgs
}

// apiError is the *openai.Error of an HTTP error, as openai-go builds it:
// the body's "error" object decoded, the response's body readable again.
func apiError(req *http.Request, res *http.Response, contents []byte) error {
	res.Body = io.NopCloser(bytes.NewReader(contents))
	aerr := &openai.Error{Request: req, Response: res, StatusCode: res.StatusCode}
	var env struct {
		Error json.RawMessage `json:"error"`
	}
	if json.Unmarshal(contents, &env) == nil && len(env.Error) > 0 && env.Error[0] == '{' {
		// An error object that does not decode leaves its fields empty:
		// the status still says what happened.
		_ = aerr.UnmarshalJSON(env.Error)
	}
	return aerr
}

// readBody reads res's body into a buffer of its Content-Length when it
// gives one (the proxy's answers do), rather than one grown by doubling
// as it is read; a length past presizeMax, which no completion reaches,
// is not trusted with an allocation that size before its bytes arrive.
func readBody(res *http.Response) ([]byte, error) {
	if n := res.ContentLength; n > 0 && n <= presizeMax {
		b := make([]byte, n)
		if _, err := io.ReadFull(res.Body, b); err != nil {
			return nil, err
		}
		return b, nil
	}
	return io.ReadAll(res.Body)
}

const presizeMax = 8 << 20
