package llmproxy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// testTimeout bounds every exchange in these tests.
const testTimeout = 10 * time.Second

// completionJSON is a small OpenAI chat completion.
const completionJSON = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"policy-v1","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}`

// chatBody is a small chat request with the placeholder model.
const chatBody = `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"What is 2+2?"}]}`

// seen is one request the fake upstream received.
type seen struct {
	path   string
	header http.Header
	body   []byte
}

// fakeUpstream is a tiny OpenAI-like server that remembers what it got.
type fakeUpstream struct {
	base string // OpenAI base URL, ending in /v1
	mu   sync.Mutex
	reqs []seen
}

func newUpstream(t *testing.T, h http.HandlerFunc) *fakeUpstream {
	t.Helper()
	u := &fakeUpstream{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.reqs = append(u.reqs, seen{path: r.URL.Path, header: r.Header.Clone(), body: body})
		u.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body))
		h(w, r)
	}))
	t.Cleanup(srv.Close)
	u.base = srv.URL + "/v1"
	return u
}

func (u *fakeUpstream) requests() []seen {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]seen(nil), u.reqs...)
}

// only returns the single request the upstream got.
func (u *fakeUpstream) only(t *testing.T) seen {
	t.Helper()
	reqs := u.requests()
	if len(reqs) != 1 {
		t.Fatalf("upstream got %d requests, want 1", len(reqs))
	}
	return reqs[0]
}

// okJSON answers completionJSON.
func okJSON(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, completionJSON)
}

// harness is a proxy behind a real loopback server, with its records.
type harness struct {
	url   string
	calls chan *osmo.LLMCall
}

func newProxy(t *testing.T, cfg llmproxy.Config) *harness {
	t.Helper()
	h := &harness{calls: make(chan *osmo.LLMCall, 64)}
	if cfg.Recorder == nil {
		cfg.Recorder = llmproxy.RecorderFunc(func(_ context.Context, c *osmo.LLMCall) { h.calls <- c })
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	p, err := llmproxy.New(cfg)
	if err != nil {
		t.Fatalf("llmproxy.New: %v", err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	h.url = srv.URL
	return h
}

// next waits for the next recorded call.
func (h *harness) next(t *testing.T) *osmo.LLMCall {
	t.Helper()
	select {
	case c := <-h.calls:
		return c
	case <-time.After(testTimeout):
		t.Fatal("no call was recorded")
		return nil
	}
}

// post sends body to the proxy and returns the response with its body read.
func post(t *testing.T, url, body string, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading response: %v", err)
	}
	return resp, b
}

// ids are the headers binding a call to rollout r1, sample s1.
var ids = map[string]string{llmproxy.HeaderRolloutID: "r1", llmproxy.HeaderSampleID: "s1"}

// apiError is the OpenAI error body.
type apiError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

// decodeError checks resp is an OpenAI error with the given status.
func decodeError(t *testing.T, resp *http.Response, body []byte, status int) apiError {
	t.Helper()
	if resp.StatusCode != status {
		t.Fatalf("status = %d, want %d; body %s", resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", ct)
	}
	var e apiError
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("error body is not JSON: %v: %s", err, body)
	}
	if e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == "" {
		t.Fatalf("error body lacks message, type or code: %s", body)
	}
	return e
}

func jsonEqual(t *testing.T, what string, got []byte, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("%s is not JSON: %v: %s", what, err, got)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatalf("bad expectation for %s: %v", what, err)
	}
	gb, _ := json.Marshal(g)
	wb, _ := json.Marshal(w)
	if !bytes.Equal(gb, wb) {
		t.Errorf("%s =\n%s\nwant\n%s", what, gb, wb)
	}
}

// mustJSON is v encoded, as a string.
func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
