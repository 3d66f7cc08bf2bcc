package osmoopenai

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
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
	id      string
	rollout *osmo.Rollout
	log     *slog.Logger
	// chat sends Complete's calls. It is the one service of a client a
	// session uses, a tenth of a whole client's size, which a rollout in
	// flight would hold: Client builds the whole client when asked.
	chat       openai.ChatCompletionService
	opts       []option.RequestOption
	clientOnce sync.Once
	client     *openai.Client

	mu    sync.Mutex
	items []json.RawMessage
	// err is the first item that could not be recorded. It fails every
	// later Complete and the sample: a conversation with a hole in it must
	// neither go to the policy nor be trained on.
	err error
}

var _ osmo.SampleSource = (*Session)(nil)

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
		id:      name,
		rollout: r,
		log:     r.Logger().With("sample_id", name),
		opts:    clientOptions(r, ep, name, opts),
	}
	s.chat = openai.NewChatCompletionService(s.opts...)
	// Registered last, so a session that failed to build leaves no sample
	// behind.
	if err := r.Register(name, s); err != nil {
		return nil, fmt.Errorf("osmoopenai.NewSession: %w", err)
	}
	return s, nil
}

// ID is the session's sample id.
func (s *Session) ID() string { return s.id }

// Client is the OpenAI client bound to this session's sample. Calls made
// with it directly are recorded by the proxy under the sample but are not
// added to the session; use Complete for that.
func (s *Session) Client() openai.Client {
	s.clientOnce.Do(func() {
		c := openai.NewClient(s.opts...)
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

// Items returns a copy of the conversation: each item is a fresh JSON object
// exactly as it is sent to the policy.
func (s *Session) Items() []osmo.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	return sampleMessages(s.items)
}

// SampleMessages implements osmo.SampleSource: the session's items as the
// JSON objects they are sent as (copies: changing them changes nothing in
// the session).
func (s *Session) SampleMessages() ([]json.RawMessage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	out := make([]json.RawMessage, len(s.items))
	for i, raw := range s.items {
		out[i] = slices.Clone(raw)
	}
	return out, nil
}

// Complete sends the session's items to the policy and appends the reply.
// params.Messages, when set, are appended to the session first; every other
// field of params is sent as given, with Model defaulting to Model. The
// reply (choices[0].message, tool calls included) is appended as the
// assistant message param it converts to, so it can be sent back as is.
func (s *Session) Complete(ctx context.Context, params openai.ChatCompletionNewParams) (*openai.ChatCompletion, error) {
	return s.complete(ctx, &params)
}

// complete is Complete on params, which it changes (Messages and Model).
// Run passes its params by reference: a rollout in flight waits for the
// policy below this frame, and each copy of the params (over a kilobyte)
// on the way down is stack it holds while it waits.
func (s *Session) complete(ctx context.Context, params *openai.ChatCompletionNewParams) (*openai.ChatCompletion, error) {
	if len(params.Messages) > 0 {
		s.AddItems(params.Messages...)
	}
	items, err := s.requestItems()
	if err != nil {
		return nil, err
	}
	params.Messages = requestMessages(items)
	if params.Model == "" {
		params.Model = Model
	}
	start := time.Now()
	resp, err := s.send(ctx, params)
	if err != nil {
		return nil, fmt.Errorf("osmoopenai: session %q: chat completion: %w", s.id, err)
	}
	if len(resp.Choices) == 0 {
		return nil, fmt.Errorf("osmoopenai: session %q: chat completion %q: %w", s.id, resp.ID, errNoChoices)
	}
	s.replied(ctx, resp, params.Model, len(items), time.Since(start))
	return resp, nil
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

// replyParam is the assistant message param of a reply, as m.ToParam()
// makes it, except that a reply with neither text nor calls keeps an
// explicit empty content: an assistant message without content or tool
// calls is not a valid request message.
func replyParam(m openai.ChatCompletionMessage) openai.ChatCompletionMessageParamUnion {
	p := m.ToParam()
	a := p.OfAssistant
	//lint:ignore SA1019 a legacy function call is a call: the message needs no content
	legacyCall := a.FunctionCall.Name != ""
	if !a.Content.OfString.Valid() && len(a.ToolCalls) == 0 && !legacyCall && !a.Refusal.Valid() {
		a.Content.OfString = openai.String("")
	}
	return p
}

// send posts params with openai-go's client. The encoding and decoding,
// which need more stack than the rest of a rollout's goroutine, run on a
// goroutine of their own (offStack): the rollout then waits for the policy
// on a 16 KiB stack, not 32: 0.86x the RSS with 10,000 rollouts held
// (osmo bench rollouts --baseline <build without it> --cluster=false
// --in-flight 10000).
func (s *Session) send(ctx context.Context, params *openai.ChatCompletionNewParams) (*openai.ChatCompletion, error) {
	var body []byte
	var err error
	// Encoded here, off the rollout's stack, and handed to openai-go as
	// the body, which it then sends as it is.
	offStack(func() { body, err = params.MarshalJSON() })
	if err != nil {
		return nil, err
	}
	var raw []byte
	var res *http.Response
	if _, err := s.chat.New(ctx, openai.ChatCompletionNewParams{}, option.WithRequestBody("application/json", body),
		option.WithResponseBodyInto(&raw), option.WithResponseInto(&res)); err != nil {
		return nil, err
	}
	// Into bytes, openai-go takes any reply: one that is not JSON fails
	// here as it would have there.
	if ct := res.Header.Get("Content-Type"); !strings.Contains(ct, "json") {
		return nil, fmt.Errorf("reply is %q, not JSON", ct)
	}
	resp := new(openai.ChatCompletion)
	offStack(func() { err = resp.UnmarshalJSON(raw) })
	if err != nil {
		return nil, fmt.Errorf("error parsing response json: %w", err)
	}
	return resp, nil
}

// offStack runs f on a goroutine of its own and waits for it.
func offStack(f func()) {
	done := make(chan any)
	go func() {
		defer func() { done <- recover() }()
		f()
	}()
	if p := <-done; p != nil {
		panic(p)
	}
}

// replied appends the reply of a call that sent n items, and logs it.
func (s *Session) replied(ctx context.Context, resp *openai.ChatCompletion, model string, n int, latency time.Duration) {
	choice := &resp.Choices[0]
	s.AddItems(replyParam(choice.Message))
	s.log.DebugContext(ctx, "osmoopenai: chat completion",
		"model", model, "messages", n, "finish_reason", choice.FinishReason,
		"tool_calls", len(choice.Message.ToolCalls), "latency", latency)
	s.rollout.LogEvent("osmoopenai_completion", map[string]any{
		"sample_id": s.id, "messages": n, "finish_reason": choice.FinishReason,
		"tool_calls": len(choice.Message.ToolCalls), "latency_ms": float64(latency) / float64(time.Millisecond),
	})
}
