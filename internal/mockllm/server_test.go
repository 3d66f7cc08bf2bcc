package mockllm_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

func TestNewValidatesOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts mockllm.Options
		want string // substring of the error, "" for success
	}{
		{"zero value", mockllm.Options{}, ""},
		{"every mode", mockllm.Options{FailMode: "hang", FailFirst: 1}, ""},
		{"unknown mode", mockllm.Options{FailMode: "502", FailEvery: 1}, `FailMode "502"`},
		{"mode without selection", mockllm.Options{FailMode: "500"}, "needs FailEvery, FailFirst or FailFraction"},
		{"selection without mode", mockllm.Options{FailEvery: 2}, "need a FailMode"},
		{"negative FailEvery", mockllm.Options{FailMode: "500", FailEvery: -1}, "FailEvery"},
		{"negative FailFirst", mockllm.Options{FailMode: "500", FailFirst: -1}, "FailFirst"},
		{"negative Latency", mockllm.Options{Latency: -time.Second}, "Latency"},
		{"negative ChunkDelay", mockllm.Options{ChunkDelay: -time.Second}, "ChunkDelay"},
		{"negative MaxRequestBytes", mockllm.Options{MaxRequestBytes: -1}, "MaxRequestBytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := mockllm.New(tc.opts)
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("New(%+v) = %v, want error containing %q", tc.opts, err, tc.want)
			}
		})
	}
}

func TestRoutes(t *testing.T) {
	srv, base := start(t, mockllm.Options{Model: "tiny"})
	body := map[string]any{"model": "openai/osmosis-rollout", "messages": []any{map[string]any{"role": "user", "content": "What is 6 times 7?"}}}
	for _, path := range []string{"/v1/chat/completions", "/r/x/s/y/v1/chat/completions", "/chat/completions"} {
		rep := do(t, http.MethodPost, base+path, body, nil)
		if rep.status != http.StatusOK || !strings.Contains(string(rep.body), `"model":"openai/osmosis-rollout"`) {
			t.Errorf("POST %s: %d %s", path, rep.status, rep.body)
		}
	}
	delete(body, "model")
	if resp := chat(t, base, body); resp["model"] != "tiny" {
		t.Errorf("a request without a model is answered as %v, want the server's", resp["model"])
	}
	if rep := do(t, http.MethodGet, base+"/health", nil, nil); rep.status != http.StatusOK || !strings.Contains(string(rep.body), `"ok"`) {
		t.Errorf("health: %d %s", rep.status, rep.body)
	}
	var models struct {
		Data []struct{ ID string } `json:"data"`
	}
	rep := do(t, http.MethodGet, base+"/v1/models", nil, nil)
	if err := json.Unmarshal(rep.body, &models); err != nil || len(models.Data) != 1 || models.Data[0].ID != "tiny" {
		t.Errorf("models: %d %s", rep.status, rep.body)
	}
	for _, tc := range []struct {
		method, path string
		status       int
	}{
		{http.MethodGet, "/v1/chat/completions", http.StatusMethodNotAllowed},
		{http.MethodPost, "/health", http.StatusMethodNotAllowed},
		{http.MethodPost, "/v1/completions", http.StatusNotFound},
		{http.MethodGet, "/v1/chat/completions/x", http.StatusNotFound},
	} {
		if rep := do(t, tc.method, base+tc.path, nil, nil); rep.status != tc.status || errorBody(t, rep).Type != "invalid_request_error" {
			t.Errorf("%s %s: %d %s, want %d", tc.method, tc.path, rep.status, rep.body, tc.status)
		}
	}
	if got := srv.Requests(); got != 4 {
		t.Errorf("Requests() = %d, want the 4 chat requests", got)
	}
}

type openAIError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// errorBody decodes an OpenAI error body, failing on any other shape.
func errorBody(t *testing.T, rep reply) openAIError {
	t.Helper()
	var raw map[string]map[string]any
	if err := json.Unmarshal(rep.body, &raw); err != nil {
		t.Fatalf("error body %s: %v", rep.body, err)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := raw["error"][k]; !ok {
			t.Fatalf("error body %s lacks error.%s", rep.body, k)
		}
	}
	var e struct{ Error openAIError }
	_ = json.Unmarshal(rep.body, &e)
	if e.Error.Message == "" {
		t.Fatalf("error body %s has no message", rep.body)
	}
	return e.Error
}

func TestBadRequests(t *testing.T) {
	_, base := start(t, mockllm.Options{MaxRequestBytes: 4096})
	user := map[string]any{"role": "user", "content": "hi"}
	for _, tc := range []struct {
		name   string
		body   any
		header map[string]string
		status int
		param  string // "" when the error names no parameter
	}{
		{"malformed JSON", `{"messages": [`, nil, 400, ""},
		{"empty body", "", nil, 400, ""},
		{"not an object", `[1, 2]`, nil, 400, ""},
		{"missing messages", map[string]any{"model": "m"}, nil, 400, "messages"},
		{"null messages", map[string]any{"messages": nil}, nil, 400, "messages"},
		{"empty messages", map[string]any{"messages": []any{}}, nil, 400, "messages"},
		{"messages not a list", map[string]any{"messages": "hi"}, nil, 400, "messages"},
		{"message not an object", map[string]any{"messages": []any{user, "hi"}}, nil, 400, "messages[1]"},
		{"null message", map[string]any{"messages": []any{nil}}, nil, 400, "messages[0]"},
		{"message without role", map[string]any{"messages": []any{map[string]any{"content": "hi"}}}, nil, 400, "messages[0].role"},
		{"tool not an object", map[string]any{"messages": []any{user}, "tools": []any{1}}, nil, 400, "tools[0]"},
		{"max_tokens zero", map[string]any{"messages": []any{user}, "max_tokens": 0}, nil, 400, "max_tokens"},
		{"max_tokens not an integer", map[string]any{"messages": []any{user}, "max_tokens": 1.5}, nil, 400, "max_tokens"},
		{"stream not a bool", map[string]any{"messages": []any{user}, "stream": "yes"}, nil, 400, "stream"},
		{"top_logprobs too many", map[string]any{"messages": []any{user}, "logprobs": true, "top_logprobs": 21}, nil, 400, "top_logprobs"},
		{"top_logprobs without logprobs", map[string]any{"messages": []any{user}, "top_logprobs": 2}, nil, 400, "top_logprobs"},
		{"unknown failure header", map[string]any{"messages": []any{user}}, map[string]string{"X-Mock-Fail": "teapot"}, 400, "X-Mock-Fail"},
		{"body too large", `{"messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, nil, 413, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := do(t, http.MethodPost, base+"/v1/chat/completions", tc.body, tc.header)
			if rep.status != tc.status {
				t.Fatalf("status %d, want %d: %s", rep.status, tc.status, rep.body)
			}
			e := errorBody(t, rep)
			got := ""
			if e.Param != nil {
				got = *e.Param
			}
			if got != tc.param || e.Type != "invalid_request_error" || (tc.param != "" && !strings.Contains(e.Message, tc.param)) {
				t.Fatalf("error %+v (param %q), want param %q named in the message", e, got, tc.param)
			}
		})
	}
}

var validChat = map[string]any{"messages": []any{map[string]any{"role": "user", "content": "What is 2 + 2?"}}}

func TestInjectedFailures(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	for _, tc := range []struct {
		mode   string
		status int
		typ    string
	}{
		{"500", 500, "server_error"},
		{"503", 503, "server_error"},
		{"429", 429, "requests"},
		{"400", 400, "invalid_request_error"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			rep := do(t, http.MethodPost, base+"/v1/chat/completions", validChat, map[string]string{"X-Mock-Fail": tc.mode})
			if rep.status != tc.status || errorBody(t, rep).Type != tc.typ {
				t.Fatalf("status %d body %s", rep.status, rep.body)
			}
			if got, want := rep.header.Get("Retry-After"), map[bool]string{true: "1"}[tc.mode == "429"]; got != want {
				t.Fatalf("Retry-After %q, want %q", got, want)
			}
		})
	}
	t.Run("malformed", func(t *testing.T) {
		rep := do(t, http.MethodPost, base+"/v1/chat/completions", validChat, map[string]string{"X-Mock-Fail": "malformed"})
		var v any
		if rep.status != http.StatusOK || json.Unmarshal(rep.body, &v) == nil {
			t.Fatalf("status %d body %s: want 200 with invalid JSON", rep.status, rep.body)
		}
	})
	t.Run("malformed stream", func(t *testing.T) {
		stream := map[string]any{"messages": validChat["messages"], "stream": true}
		rep := do(t, http.MethodPost, base+"/v1/chat/completions", stream, map[string]string{"X-Mock-Fail": "malformed"})
		events := sseEvents(t, rep.body)
		var v any
		if rep.status != http.StatusOK || json.Unmarshal([]byte(events[0]), &v) == nil || events[len(events)-1] == "[DONE]" {
			t.Fatalf("status %d events %q: want a garbage data line and no [DONE]", rep.status, events)
		}
	})
	t.Run("a good request after a failure succeeds", func(t *testing.T) {
		chat(t, base, validChat)
	})
}

func TestFailureSchedule(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts mockllm.Options
		fail []bool // per request, in order
	}{
		{"FailEvery", mockllm.Options{FailMode: "503", FailEvery: 2}, []bool{false, true, false, true, false}},
		{"FailFirst", mockllm.Options{FailMode: "500", FailFirst: 2}, []bool{true, true, false, false, false}},
		{"both", mockllm.Options{FailMode: "429", FailFirst: 1, FailEvery: 3}, []bool{true, false, true, false, false, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, base := start(t, tc.opts)
			for i, fail := range tc.fail {
				// Health checks do not count as requests.
				do(t, http.MethodGet, base+"/health", nil, nil)
				rep := do(t, http.MethodPost, base+"/v1/chat/completions", validChat, nil)
				if got := rep.status != http.StatusOK; got != fail {
					t.Fatalf("request %d: status %d, want failing=%v", i+1, rep.status, fail)
				}
			}
			if got := srv.Requests(); got != int64(len(tc.fail)) {
				t.Fatalf("Requests() = %d, want %d", got, len(tc.fail))
			}
		})
	}
}

func TestHangEndsWhenTheClientGoesAway(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   mockllm.Options
		header string
	}{
		{"header", mockllm.Options{}, "hang"},
		{"flag", mockllm.Options{FailMode: "hang", FailFirst: 1}, ""},
		{"latency", mockllm.Options{Latency: time.Hour}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := mockllm.New(tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			handlerDone := make(chan struct{})
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer close(handlerDone)
				s.ServeHTTP(w, r)
			}))
			t.Cleanup(ts.Close)
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
			if tc.header != "" {
				req.Header.Set("X-Mock-Fail", tc.header)
			}
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
				t.Fatalf("got a response (%d) from a hanging server", resp.StatusCode)
			}
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("error %v, want the client's deadline", err)
			}
			select {
			case <-handlerDone:
			case <-time.After(testTimeout):
				t.Fatal("handler still running after the client left")
			}
		})
	}
}

func TestStreamStopsWhenTheClientGoesAway(t *testing.T) {
	s, err := mockllm.New(mockllm.Options{ChunkDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	handlerDone := make(chan struct{})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(handlerDone)
		s.ServeHTTP(w, r)
	}))
	t.Cleanup(ts.Close)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/v1/chat/completions",
		strings.NewReader(`{"stream":true,"messages":[{"role":"user","content":"What is 1 + 1?"}]}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	// The first chunk is flushed before the long delay.
	buf := make([]byte, 6)
	if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "data: " {
		t.Fatalf("first read %q, %v", buf, err)
	}
	cancel()
	resp.Body.Close()
	select {
	case <-handlerDone:
	case <-time.After(testTimeout):
		t.Fatal("stream handler still running after the client left")
	}
}
