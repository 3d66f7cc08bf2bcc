package osmoopenai

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/osmo-rl/osmo"
)

// Session is an in-memory conversation bound to one sample of the active
// rollout: the Go counterpart of OsmosisMemorySession. It registers itself
// as a sample source under its name, so the grader reads its items as the
// sample's messages, and its client sends every call under that sample id.
//
// Items are OpenAI chat messages kept as the JSON objects that go on the
// wire. A Session is safe for concurrent use; calls to Complete that
// overlap each send the items recorded when they started.
type Session struct {
	id string
	// direct sends Complete's calls, or chat when the session was made
	// with request options (see direct). The whole client is built only
	// when Client asks for it: it holds a copy of the options for each of
	// the API's services, about 10 KiB, which a rollout in flight need not
	// pay.
	direct *direct
	chat   openai.ChatCompletionService
	// ep and userOpts make the client's options (options), built only
	// when a client is: a rollout in flight need not hold them.
	ep         osmo.Endpoint
	userOpts   []option.RequestOption
	clientOnce sync.Once
	client     *openai.Client
	log        *slog.Logger
	rollout    *osmo.Rollout

	mu    sync.Mutex
	items []json.RawMessage
	// err is the first item that could not be recorded. It fails every
	// later Complete and the sample: a conversation with a hole in it must
	// neither go to the policy nor be trained on.
	err error
}

var (
	_ osmo.SampleSource = (*Session)(nil)
	_ osmo.SampleJSON   = (*Session)(nil)
)

// NewSession creates a session named name (the sample id; "" picks a random
// one with osmo.NewSampleID) and registers it with the rollout in ctx. opts
// go to its client as in NewClient.
//
// Outside AgentWorkflow.Run the error wraps osmo.ErrNoRollout; a second
// session under the same name in one rollout wraps osmo.ErrDuplicateSample.
func NewSession(ctx context.Context, name string, opts ...option.RequestOption) (*Session, error) {
	r, err := osmo.RolloutFromContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("osmoopenai.NewSession: %w", err)
	}
	if name == "" {
		name = osmo.NewSampleID()
	}
	ep, err := endpoint(r, name)
	if err != nil {
		return nil, fmt.Errorf("osmoopenai.NewSession: %w", err)
	}
	s := &Session{
		id:       name,
		ep:       ep,
		userOpts: opts,
		log:      r.Logger().With("sample_id", name),
		rollout:  r,
	}
	if len(opts) == 0 {
		s.direct = newDirect(ep, r.ID, name)
	} else {
		// As openai.NewClient configures its Chat.Completions.
		s.chat = openai.NewChatCompletionService(append(openai.DefaultClientOptions(), s.options()...)...)
	}
	// Registered last, so a session that failed to build leaves no sample
	// behind.
	if err := r.Register(name, s); err != nil {
		return nil, fmt.Errorf("osmoopenai.NewSession: %w", err)
	}
	return s, nil
}

// options are the options of a client bound to the session's sample.
func (s *Session) options() []option.RequestOption {
	return clientOptions(s.rollout, s.ep, s.id, s.userOpts)
}

// ID is the session's sample id.
func (s *Session) ID() string { return s.id }

// Client is the OpenAI client bound to this session's sample. Calls made
// with it directly are recorded by the proxy under the sample but are not
// added to the session; use Complete for that.
func (s *Session) Client() openai.Client {
	s.clientOnce.Do(func() {
		c := openai.NewClient(s.options()...)
		s.client = &c
	})
	return *s.client
}

// AddItems appends messages to the conversation, recorded as the JSON
// objects they encode to. An item that does not encode to a JSON object
// (an empty union, a param whose value cannot be encoded) is not recorded;
// the session then fails its next Complete and its sample, naming the item.
func (s *Session) AddItems(items ...openai.ChatCompletionMessageParamUnion) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, item := range items {
		raw, err := encodeItem(item)
		if err != nil {
			if s.err == nil {
				s.err = fmt.Errorf("osmoopenai: session %q: item %d: %w", s.id, len(s.items), err)
				s.log.Error("osmoopenai: session item not recorded", "item", len(s.items), "error", err)
			}
			continue
		}
		s.items = append(s.items, raw)
	}
}

// encodeItem encodes a message param, requiring a JSON object.
func encodeItem(item openai.ChatCompletionMessageParamUnion) (json.RawMessage, error) {
	if raw, ok := appendItem(make([]byte, 0, 128), &item); ok {
		return raw, nil
	}
	raw, err := json.Marshal(item)
	if err != nil {
		return nil, fmt.Errorf("encode message: %w", err)
	}
	// json.Marshal checks what a MarshalJSON returns and compacts it:
	// the first byte tells an object.
	if len(raw) == 0 || raw[0] != '{' {
		return nil, fmt.Errorf("message encodes to %s, not a JSON object", truncate(raw, 64))
	}
	return raw, nil
}

// Items returns a copy of the conversation: each item is a fresh JSON object
// exactly as it is sent to the policy.
func (s *Session) Items() []osmo.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]osmo.Message, 0, len(s.items))
	for _, raw := range s.items {
		var m osmo.Message
		// Every stored item was checked to decode as an object when added.
		_ = json.Unmarshal(raw, &m)
		out = append(out, m)
	}
	return out
}

// SampleMessagesJSON implements osmo.SampleJSON: the session's items as
// the JSON objects they are sent as (copies: changing them changes
// nothing in the session).
func (s *Session) SampleMessagesJSON() ([]json.RawMessage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	out := make([]json.RawMessage, len(s.items))
	for i, raw := range s.items {
		out[i] = bytes.Clone(raw)
	}
	return out, nil
}

// SampleMessages implements osmo.SampleSource: the session's items.
func (s *Session) SampleMessages() ([]osmo.Message, error) {
	s.mu.Lock()
	err := s.err
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return s.Items(), nil
}

// Complete sends the session's items to the policy and appends the reply.
// params.Messages, when set, are appended to the session first; every other
// field of params is sent as given, with Model defaulting to Model. The
// reply (choices[0].message, tool calls included) is appended as the
// assistant message param it converts to, so it can be sent back as is.
func (s *Session) Complete(ctx context.Context, params openai.ChatCompletionNewParams) (*openai.ChatCompletion, error) {
	resp, _, err := s.complete(ctx, &params, nil, leanNone)
	return resp, err
}

// complete is Complete on params, which it changes (Messages and Model).
// The params, over a kilobyte, are passed by reference: Run's turns and
// the direct path copy them no more (openai-go's New takes its own copy).
// enc, when not nil, is params encoded (encodeParams), as Run encodes them
// once for all its turns. lean says which replies the caller reads no
// further than their message and tool calls, returning none of them as a
// completion (Run before its last turn: one that asks for tools; RunText:
// all): the direct path decodes those no further (decodeLean), into a
// kept completion that turn holds, for the caller to let go (done) once
// its turn is over.
//
// Its frame is below every frame of the call (the in-process proxy's
// included), and a rollout in flight parks its goroutine inside that call:
// what the call does not need (the path through openai-go, the reply's
// bookkeeping) is in functions of their own, so that the goroutine of a
// rollout in flight fits a 16 KiB stack instead of 32 (docs/performance.md).
func (s *Session) complete(ctx context.Context, params *openai.ChatCompletionNewParams, enc *encodedParams, lean leanReplies) (_ *openai.ChatCompletion, turn *leanCompletion, _ error) {
	if len(params.Messages) > 0 {
		s.AddItems(params.Messages...)
	}
	items, err := s.requestItems()
	if err != nil {
		return nil, nil, err
	}
	params.Messages = nil
	if params.Model == "" {
		params.Model = Model
	}
	start := time.Now()
	var resp *openai.ChatCompletion
	if s.direct != nil {
		resp, turn, err = s.direct.complete(ctx, params, items, enc, lean)
	} else {
		resp, err = s.viaClient(ctx, params, items)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("osmoopenai: session %q: chat completion: %w", s.id, err)
	}
	if len(resp.Choices) == 0 {
		turn.done()
		return nil, nil, fmt.Errorf("osmoopenai: session %q: chat completion %q: %w", s.id, resp.ID, errNoChoices)
	}
	s.replied(ctx, resp, params.Model, len(items), time.Since(start))
	return resp, turn, nil
}

// viaClient sends params with items as its messages through openai-go.
func (s *Session) viaClient(ctx context.Context, params *openai.ChatCompletionNewParams, items []json.RawMessage) (*openai.ChatCompletion, error) {
	p := *params
	p.Messages = messageOverrides(items)
	return s.chat.New(ctx, p)
}

// replied appends the reply of a call that sent n items, and logs it.
func (s *Session) replied(ctx context.Context, resp *openai.ChatCompletion, model string, n int, latency time.Duration) {
	choice := &resp.Choices[0]
	s.AddItems(replyParam(&choice.Message))
	s.log.DebugContext(ctx, "osmoopenai: chat completion",
		"model", model, "messages", n, "finish_reason", choice.FinishReason,
		"tool_calls", len(choice.Message.ToolCalls), "latency", latency)
	s.rollout.LogEvent("osmoopenai_completion", map[string]any{
		"sample_id": s.id, "messages": n, "finish_reason": choice.FinishReason,
		"tool_calls": len(choice.Message.ToolCalls), "latency_ms": float64(latency) / float64(time.Millisecond),
	})
}

// requestItems are the items to send: the recorded JSON objects as they
// are now. Items are only ever appended, so the slice returned stays as it
// is while later ones are added.
func (s *Session) requestItems() ([]json.RawMessage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	if len(s.items) == 0 {
		return nil, fmt.Errorf("osmoopenai: session %q has no messages to send", s.id)
	}
	return s.items[:len(s.items):len(s.items)], nil
}

// replyParam is the assistant message param of a reply: what m.ToParam()
// makes of it (TestReplyParamIsToParam), built from m in place. A reply
// with neither text nor calls keeps an explicit empty content: an
// assistant message without content or tool calls is not a valid request
// message.
//
// ToParam passes the message (over a kilobyte with its JSON metadata) by
// value through three calls and decodes every tool call again from its
// raw JSON: it grew a rollout's goroutine to 32 KiB of stack, which the
// rollout then held while it waited for the policy's next answer.
func replyParam(m *openai.ChatCompletionMessage) openai.ChatCompletionMessageParamUnion {
	a := &openai.ChatCompletionAssistantMessageParam{Role: m.Role}
	if m.Content != "" {
		a.Content.OfString = openai.String(m.Content)
	}
	if m.Refusal != "" {
		a.Refusal = openai.String(m.Refusal)
	}
	a.Audio.ID = m.Audio.ID
	a.FunctionCall.Arguments, a.FunctionCall.Name = m.FunctionCall.Arguments, m.FunctionCall.Name
	for i := range m.ToolCalls {
		// ToParam's variants: a call of another type is an empty union.
		tc := &m.ToolCalls[i]
		var u openai.ChatCompletionMessageToolCallUnionParam
		switch tc.Type {
		case "function":
			u.OfFunction = &openai.ChatCompletionMessageFunctionToolCallParam{ID: tc.ID,
				Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Arguments: tc.Function.Arguments, Name: tc.Function.Name}}
		case "custom":
			u.OfCustom = &openai.ChatCompletionMessageCustomToolCallParam{ID: tc.ID,
				Custom: openai.ChatCompletionMessageCustomToolCallCustomParam{Input: tc.Custom.Input, Name: tc.Custom.Name}}
		}
		a.ToolCalls = append(a.ToolCalls, u)
	}
	if !a.Content.OfString.Valid() && len(a.Content.OfArrayOfContentParts) == 0 &&
		len(a.ToolCalls) == 0 && a.FunctionCall.Name == "" && !a.Refusal.Valid() {
		a.Content.OfString = openai.String("")
	}
	return openai.ChatCompletionMessageParamUnion{OfAssistant: a}
}

func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "..."
}
