package osmoeino

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"sync"

	"github.com/cloudwego/eino-ext/components/model/openai"
	"github.com/cloudwego/eino/components"
	"github.com/cloudwego/eino/components/model"
	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
)

// Header names that bind a call to its rollout and sample.
const (
	headerRolloutID = "X-Rollout-Id"
	headerSampleID  = "X-Sample-Id"
)

// Option sets a sampling parameter or the transport of NewChatModel.
type Option func(*settings)

type settings struct {
	temperature *float32
	topP        *float32
	maxTokens   *int
	stop        []string
	seed        *int
	httpClient  *http.Client
}

// WithTemperature sets the sampling temperature, in [0, 2].
func WithTemperature(t float32) Option { return func(s *settings) { s.temperature = &t } }

// WithTopP sets nucleus sampling's top_p, in (0, 1].
func WithTopP(p float32) Option { return func(s *settings) { s.topP = &p } }

// WithMaxTokens bounds each completion. It is sent as max_tokens, the
// parameter vLLM, SGLang and the Osmosis completion_params use.
func WithMaxTokens(n int) Option { return func(s *settings) { s.maxTokens = &n } }

// WithStop sets stop sequences.
func WithStop(stop ...string) Option {
	return func(s *settings) { s.stop = slices.Clone(stop) }
}

// WithSeed sets the sampling seed.
func WithSeed(seed int) Option { return func(s *settings) { s.seed = &seed } }

// WithHTTPClient sets the client used when the rollout's endpoint has none;
// the endpoint's wins, as it is instrumented for tracing.
func WithHTTPClient(c *http.Client) Option { return func(s *settings) { s.httpClient = c } }

// OptionError reports an option given an invalid value; Field is the
// request field it sets ("temperature", "top_p", "max_tokens", "stop").
type OptionError struct {
	Field string
	Err   error
}

func (e *OptionError) Error() string { return fmt.Sprintf("option %s: %v", e.Field, e.Err) }

func (e *OptionError) Unwrap() error { return e.Err }

func (s *settings) validate() error {
	// Negated comparisons so NaN is refused too.
	if t := s.temperature; t != nil && !(*t >= 0 && *t <= 2) {
		return &OptionError{Field: "temperature", Err: fmt.Errorf("must be within [0, 2], got %v", *t)}
	}
	if p := s.topP; p != nil && !(*p > 0 && *p <= 1) {
		return &OptionError{Field: "top_p", Err: fmt.Errorf("must be within (0, 1], got %v", *p)}
	}
	if n := s.maxTokens; n != nil && *n <= 0 {
		return &OptionError{Field: "max_tokens", Err: fmt.Errorf("must be positive, got %d", *n)}
	}
	for i, stop := range s.stop {
		if stop == "" {
			return &OptionError{Field: "stop", Err: fmt.Errorf("sequence %d is empty", i)}
		}
	}
	return nil
}

// NewChatModel returns Eino's OpenAI chat model bound to the active rollout
// (from ctx) as sampleID: its calls go to the rollout's endpoint for that
// sample with its bearer, osmo.PlaceholderModel and the x-rollout-id and
// x-sample-id headers, through the endpoint's HTTP client when it has one.
//
// The model is the source of sampleID's sample: the conversation of its
// latest Generate or Stream call (read to its end), as OpenAI chat
// messages (see ChatMessages). Models from WithTools share the record.
//
// An empty sampleID gets a random one. Outside a rollout the error wraps
// osmo.ErrNoRollout; a sampleID already registered, osmo.ErrDuplicateSample.
func NewChatModel(ctx context.Context, sampleID string, opts ...Option) (model.ToolCallingChatModel, error) {
	r, err := osmo.RolloutFromContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("osmoeino.NewChatModel: %w", err)
	}
	var s settings
	for _, o := range opts {
		if o != nil {
			o(&s)
		}
	}
	if err := s.validate(); err != nil {
		return nil, fmt.Errorf("osmoeino.NewChatModel: %w", err)
	}
	if sampleID == "" {
		sampleID = osmo.NewSampleID()
	}
	if err := osmo.ValidSampleID(sampleID); err != nil {
		return nil, fmt.Errorf("osmoeino.NewChatModel: %w", err)
	}

	ep := r.Endpoint(sampleID)
	if err := checkBaseURL(ep.BaseURL); err != nil {
		return nil, fmt.Errorf("osmoeino.NewChatModel: rollout %q sample %q: endpoint base URL: %w", r.ID, sampleID, err)
	}
	header := http.Header{
		headerRolloutID: {r.ID},
		headerSampleID:  {sampleID},
	}
	// The runtime's own headers win: it is what the proxy in front of the
	// policy was told to expect.
	for k, v := range ep.Headers {
		header.Set(k, v)
	}
	base := ep.HTTPClient
	if base == nil {
		base = s.httpClient
	}
	inner, err := openai.NewChatModel(ctx, &openai.ChatModelConfig{
		BaseURL:     ep.BaseURL,
		APIKey:      ep.APIKey,
		Model:       osmo.PlaceholderModel,
		HTTPClient:  withHeaders(base, header),
		Temperature: s.temperature,
		TopP:        s.topP,
		MaxTokens:   s.maxTokens,
		Stop:        s.stop,
		Seed:        s.seed,
	})
	if err != nil {
		return nil, fmt.Errorf("osmoeino.NewChatModel: sample %q: %w", sampleID, err)
	}

	rec := &recorder{sampleID: sampleID}
	// Register last, so a model that failed to build leaves no empty source.
	if err := r.Register(sampleID, rec); err != nil {
		return nil, fmt.Errorf("osmoeino.NewChatModel: %w", err)
	}
	log := r.Logger().With("sample_id", sampleID)
	log.DebugContext(ctx, "osmoeino: chat model bound to rollout", "base_url", ep.BaseURL)
	return &chatModel{inner: inner, rec: rec, log: log}, nil
}

// checkBaseURL refuses what would send a rollout's calls elsewhere: with an
// empty base URL the OpenAI client falls back to api.openai.com.
func checkBaseURL(raw string) error {
	if raw == "" {
		return errors.New("empty (the rollout runtime gave no endpoint)")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return err
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%q is not an absolute http(s) URL", raw)
	}
	return nil
}

// withHeaders returns a copy of base (nil: a default client) whose transport
// adds header to every request: a caller's own per-call header option
// would replace the OpenAI model's.
func withHeaders(base *http.Client, header http.Header) *http.Client {
	c := &http.Client{}
	if base != nil {
		*c = *base
	}
	rt := c.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	c.Transport = &headerTransport{base: rt, header: header}
	return c
}

type headerTransport struct {
	base   http.RoundTripper
	header http.Header
}

func (t *headerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	for k, v := range t.header {
		req.Header[k] = v
	}
	return t.base.RoundTrip(req)
}

// CloseIdleConnections reaches the wrapped transport.
func (t *headerTransport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// chatModel records the conversation flowing through inner.
type chatModel struct {
	inner model.ToolCallingChatModel
	rec   *recorder
	log   *slog.Logger
}

var (
	_ model.ToolCallingChatModel = (*chatModel)(nil)
	_ components.Typer           = (*chatModel)(nil)
	_ components.Checker         = (*chatModel)(nil)
)

// Generate implements model.BaseChatModel.
func (m *chatModel) Generate(ctx context.Context, in []*schema.Message, opts ...model.Option) (*schema.Message, error) {
	call, err := m.rec.begin(in)
	if err != nil {
		return nil, err
	}
	out, err := m.inner.Generate(ctx, in, opts...)
	if err != nil {
		m.log.DebugContext(ctx, "osmoeino: chat completion failed", "error", err)
		return nil, fmt.Errorf("osmoeino: sample %q: generate: %w", m.rec.sampleID, err)
	}
	if err := m.rec.finish(call, out); err != nil {
		return nil, err
	}
	m.log.DebugContext(ctx, "osmoeino: chat completion", "messages", len(in), "tool_calls", len(out.ToolCalls))
	return out, nil
}

// Stream implements model.BaseChatModel. The chunks are passed on as they
// arrive; the reply is recorded when the stream ends.
func (m *chatModel) Stream(ctx context.Context, in []*schema.Message, opts ...model.Option) (*schema.StreamReader[*schema.Message], error) {
	call, err := m.rec.begin(in)
	if err != nil {
		return nil, err
	}
	sr, err := m.inner.Stream(ctx, in, opts...)
	if err != nil {
		m.log.DebugContext(ctx, "osmoeino: chat completion failed", "error", err, "stream", true)
		return nil, fmt.Errorf("osmoeino: sample %q: stream: %w", m.rec.sampleID, err)
	}
	out, w := schema.Pipe[*schema.Message](1)
	go m.relay(ctx, call, len(in), sr, w)
	return out, nil
}

// relay copies sr to w and records the chunks' concatenation once sr ends.
func (m *chatModel) relay(ctx context.Context, call uint64, inputs int, sr *schema.StreamReader[*schema.Message], w *schema.StreamWriter[*schema.Message]) {
	defer w.Close()
	defer sr.Close()
	defer func() {
		// This goroutine is outside the workflow's recover: a panic here
		// would end the whole process.
		if p := recover(); p != nil {
			w.Send(nil, fmt.Errorf("osmoeino: sample %q: stream relay panicked: %v", m.rec.sampleID, p))
		}
	}()
	var chunks []*schema.Message
	for {
		chunk, err := sr.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			w.Send(nil, fmt.Errorf("osmoeino: sample %q: stream: %w", m.rec.sampleID, err))
			return
		}
		if chunk == nil {
			continue
		}
		chunks = append(chunks, chunk)
		if closed := w.Send(chunk, nil); closed {
			// The reader never saw the whole reply: it is not recorded.
			m.log.DebugContext(ctx, "osmoeino: stream closed before its end; reply not recorded")
			return
		}
	}
	if len(chunks) == 0 {
		w.Send(nil, fmt.Errorf("osmoeino: sample %q: stream ended without a message", m.rec.sampleID))
		return
	}
	reply, err := schema.ConcatMessages(chunks)
	if err != nil {
		w.Send(nil, fmt.Errorf("osmoeino: sample %q: concatenate streamed reply: %w", m.rec.sampleID, err))
		return
	}
	if err := m.rec.finish(call, reply); err != nil {
		w.Send(nil, err)
		return
	}
	m.log.DebugContext(ctx, "osmoeino: chat completion", "messages", inputs, "tool_calls", len(reply.ToolCalls), "stream", true)
}

// WithTools implements model.ToolCallingChatModel: the tool-bound model keeps
// the rollout binding and records into the same sample.
func (m *chatModel) WithTools(tools []*schema.ToolInfo) (model.ToolCallingChatModel, error) {
	inner, err := m.inner.WithTools(tools)
	if err != nil {
		return nil, fmt.Errorf("osmoeino: sample %q: bind tools: %w", m.rec.sampleID, err)
	}
	return &chatModel{inner: inner, rec: m.rec, log: m.log}, nil
}

// GetType names the wrapped model's type in Eino callbacks.
func (m *chatModel) GetType() string {
	if t, ok := components.GetType(m.inner); ok {
		return t
	}
	return "OsmoRollout"
}

// IsCallbacksEnabled reports whether the wrapped model runs Eino callbacks
// itself, so graphs do not run them again around the wrapper.
func (m *chatModel) IsCallbacksEnabled() bool { return components.IsCallbacksEnabled(m.inner) }

// recorder is a chat model's sample source: the latest call's request
// messages and reply.
type recorder struct {
	sampleID string

	mu    sync.Mutex
	calls uint64         // calls begun; numbers the latest one
	input []osmo.Message // replaced, never modified in place
	reply osmo.Message   // nil until the latest call answered
}

// begin records the request of a new call and returns its number, converted
// now since later steps may change Eino's messages.
func (r *recorder) begin(in []*schema.Message) (uint64, error) {
	msgs, err := ChatMessages(in)
	if err != nil {
		return 0, fmt.Errorf("osmoeino: sample %q: record request: %w", r.sampleID, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	r.input, r.reply = msgs, nil
	return r.calls, nil
}

// finish records the reply of call unless a later call has begun since.
func (r *recorder) finish(call uint64, reply *schema.Message) error {
	msgs, err := ChatMessages([]*schema.Message{reply})
	if err != nil {
		return fmt.Errorf("osmoeino: sample %q: record reply: %w", r.sampleID, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if call == r.calls {
		r.reply = msgs[0]
	}
	return nil
}

// SampleMessages implements osmo.SampleSource.
func (r *recorder) SampleMessages() ([]json.RawMessage, error) {
	r.mu.Lock()
	calls, input, reply := r.calls, r.input, r.reply
	r.mu.Unlock()
	if calls == 0 {
		return nil, fmt.Errorf("osmoeino: sample %q: the chat model was never called, so there is no conversation to grade", r.sampleID)
	}
	msgs := make([]osmo.Message, 0, len(input)+1)
	msgs = append(msgs, input...)
	if reply != nil {
		msgs = append(msgs, reply)
	}
	return osmo.EncodeMessages(msgs)
}
