package osmoopenai_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/osmotest"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

const (
	// upstreamModel is what the proxy sends instead of the placeholder.
	upstreamModel = "mock-policy"
	// token is the bearer the proxy requires of clients.
	token = "tok-test"
	task  = "What is 6 times 7?"
)

// testCtx bounds a test.
func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// runtime is a osmo.Runtime whose endpoint is given by a function.
type runtime struct {
	endpoint func(sampleID string) osmo.Endpoint
}

func (r runtime) Endpoint(sampleID string) osmo.Endpoint { return r.endpoint(sampleID) }
func (runtime) Logger() *slog.Logger                     { return slog.New(slog.DiscardHandler) }
func (runtime) LogEvent(string, map[string]any)          {}
func (runtime) RecordToolCall(string, time.Duration)     {}

// rolloutCtx returns a ctx carrying a rollout whose samples call baseURL
// (a function of the sample id) with token.
func rolloutCtx(t *testing.T, id string, baseURL func(sampleID string) string) (context.Context, *osmo.Rollout) {
	t.Helper()
	r := osmotest.NewRollout(id, runtime{endpoint: func(sampleID string) osmo.Endpoint {
		return osmo.Endpoint{BaseURL: baseURL(sampleID), APIKey: token}
	}})
	return osmotest.ContextWithRollout(testCtx(t), r), r
}

// headerLog records the headers of the requests a handler receives.
type headerLog struct {
	mu      sync.Mutex
	headers []http.Header
}

func (l *headerLog) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.headers = append(l.headers, r.Header.Clone())
		l.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

func (l *headerLog) all() []http.Header {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]http.Header(nil), l.headers...)
}

// stack is the mock policy behind a real LLM proxy, both on loopback, with
// the headers each of them received.
type stack struct {
	proxyURL string
	store    *llmproxy.Store
	atProxy  headerLog
	upstream headerLog
}

func newStack(t *testing.T) *stack {
	t.Helper()
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	s := &stack{store: llmproxy.NewStore(0, 0)}
	mockSrv := httptest.NewServer(s.upstream.wrap(mock))
	t.Cleanup(mockSrv.Close)
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:          llmproxy.StaticRouter(llmproxy.Route{BaseURL: mockSrv.URL + "/v1", Model: upstreamModel, ClientToken: token}),
		Recorder:        s.store,
		Timeout:         10 * time.Second,
		RequireSampleID: true,
	})
	if err != nil {
		t.Fatalf("llmproxy.New: %v", err)
	}
	proxySrv := httptest.NewServer(s.atProxy.wrap(proxy))
	t.Cleanup(proxySrv.Close)
	s.proxyURL = proxySrv.URL
	return s
}

// rollout returns a ctx carrying rollout id bound to the stack's proxy.
func (s *stack) rollout(t *testing.T, id string) (context.Context, *osmo.Rollout) {
	return rolloutCtx(t, id, func(sampleID string) string { return llmproxy.BaseURLFor(s.proxyURL, id, sampleID) })
}

// scripted is an upstream that answers chat completions with canned
// messages in turn (the last one repeats) and keeps every request body.
type scripted struct {
	URL string

	mu       sync.Mutex
	replies  []string
	bodies   []map[string]any
	requests int
}

func newScripted(t *testing.T, replies ...string) *scripted {
	t.Helper()
	s := &scripted{replies: replies}
	srv := httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(srv.Close)
	s.URL = srv.URL + "/v1"
	return s
}

func (s *scripted) serve(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	var body map[string]any
	_ = json.Unmarshal(b, &body)
	s.mu.Lock()
	s.bodies = append(s.bodies, body)
	n := s.requests
	s.requests++
	reply := s.replies[min(n, len(s.replies)-1)]
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, reply)
}

func (s *scripted) requestBodies() []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]map[string]any(nil), s.bodies...)
}

// completion is a chat completion body whose message is msg (JSON).
func completion(msg string) string {
	return `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"stop","message":` + msg + `}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`
}

// roles lists the messages' roles.
func roles(msgs []osmo.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i], _ = m["role"].(string)
	}
	return out
}

// mustJSON decodes b (a JSON array of objects) for comparison.
func mustJSON(t *testing.T, b []byte) []osmo.Message {
	t.Helper()
	var out []osmo.Message
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return out
}
