package llmproxy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// The proxy parses what clients send (chat-completions and Responses
// bodies) and what the policy streams back (SSE). These fuzz targets drive
// the whole handler, in memory: the upstream is a RoundTripper, the client
// an httptest.ResponseRecorder. Seeds are in testdata/fuzz.

// fuzzUpstream answers every upstream call with status, contentType and
// body, and counts the calls.
type fuzzUpstream struct {
	mu          sync.Mutex
	status      int
	contentType string
	body        []byte
	calls       int
}

func (u *fuzzUpstream) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.calls++
	return &http.Response{
		StatusCode: u.status, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:        http.Header{"Content-Type": {u.contentType}},
		Body:          io.NopCloser(bytes.NewReader(u.body)),
		ContentLength: int64(len(u.body)),
		Request:       r,
	}, nil
}

// fuzzProxy is a proxy in front of up that records into the returned
// channel; retries are immediate so a failing seed costs no time. It asks
// for token ids, as osmo's proxy does by default.
func fuzzProxy(f *testing.F, up *fuzzUpstream) (http.Handler, chan *osmo.LLMCall) {
	calls := make(chan *osmo.LLMCall, 16)
	p, err := llmproxy.New(llmproxy.Config{
		AskTokens: true,
		Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://policy.invalid/v1", Model: "policy-v1"}),
		Recorder:  llmproxy.RecorderFunc(func(_ context.Context, c *osmo.LLMCall) { calls <- c }),
		Retry:     llmproxy.RetryPolicy{MaxRetries: 1, BaseDelay: time.Microsecond, MaxDelay: time.Microsecond},
		Transport: up,
		Logger:    slog.New(slog.DiscardHandler),
	})
	if err != nil {
		f.Fatal(err)
	}
	return p, calls
}

// serve posts body to path through h with the sample headers.
func serve(h http.Handler, path string, body []byte) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(llmproxy.HeaderRolloutID, "r1")
	req.Header.Set(llmproxy.HeaderSampleID, "s1")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w
}

// drain takes the calls recorded so far.
func drain(calls chan *osmo.LLMCall) []*osmo.LLMCall {
	var out []*osmo.LLMCall
	for {
		select {
		case c := <-calls:
			out = append(out, c)
		default:
			return out
		}
	}
}

// checkAnswer holds for any request: the answer is the upstream's 200 or a
// client error with an OpenAI error body, never a 5xx (the upstream always
// answers), and a request that reached the upstream is recorded once.
func checkAnswer(t *testing.T, w *httptest.ResponseRecorder, up *fuzzUpstream, calls chan *osmo.LLMCall) {
	t.Helper()
	recorded := drain(calls)
	switch {
	case w.Code == http.StatusOK:
		if up.calls == 0 {
			t.Fatalf("200 without an upstream call: %s", w.Body.Bytes())
		}
	case w.Code >= 400 && w.Code < 500:
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Message == "" {
			t.Fatalf("%d with a body that is not an OpenAI error: %q", w.Code, w.Body.Bytes())
		}
		if up.calls > 0 {
			t.Fatalf("a request refused with %d reached the upstream", w.Code)
		}
	default:
		t.Fatalf("status %d: %q", w.Code, w.Body.Bytes())
	}
	if up.calls > 0 && len(recorded) != 1 {
		t.Fatalf("%d calls recorded for one request", len(recorded))
	}
}

// FuzzChatRequest: any body posted to /v1/chat/completions is forwarded
// and recorded, or refused with a 4xx naming the problem.
func FuzzChatRequest(f *testing.F) {
	f.Add([]byte(chatBody))
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"logprobs":true,"extra_body":{"return_token_ids":true}}`))
	f.Add([]byte(`{"messages":"no"}`))
	f.Add([]byte(`{"model":"m","messages":[],"stream":true}`))
	// Streams are fuzzed here too: the upstream answers JSON, and the oracle
	// no longer guesses from the bytes which bodies ask for a stream.
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi"}],"str\u0065am":true,"Stream":false}`))
	up := &fuzzUpstream{status: http.StatusOK, contentType: "application/json", body: []byte(completionJSON)}
	h, calls := fuzzProxy(f, up)
	f.Fuzz(func(t *testing.T, body []byte) {
		up.calls = 0
		checkAnswer(t, serve(h, "/v1/chat/completions", body), up, calls)
	})
}

// FuzzResponsesRequest: any body posted to /v1/responses is translated and
// forwarded, or refused with a 4xx naming the problem.
func FuzzResponsesRequest(f *testing.F) {
	f.Add([]byte(`{"model":"m","input":"What is 2+2?"}`))
	f.Add([]byte(`{"model":"m","instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c1","output":"4"}],"tools":[{"type":"function","name":"f","parameters":{}}],"tool_choice":"auto","text":{"format":{"type":"json_schema","name":"x","schema":{}}}}`))
	f.Add([]byte(`{"input":[{"role":"system","content":5}]}`))
	f.Add([]byte(`{"model":"m","input":"hi","stream":true}`))
	up := &fuzzUpstream{status: http.StatusOK, contentType: "application/json", body: []byte(completionJSON)}
	h, calls := fuzzProxy(f, up)
	f.Fuzz(func(t *testing.T, body []byte) {
		up.calls = 0
		w := serve(h, "/v1/responses", body)
		checkAnswer(t, w, up, calls)
		if w.Code == http.StatusOK {
			var resp struct {
				Object string `json:"object"`
				Status string `json:"status"`
			}
			if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || resp.Object != "response" {
				t.Fatalf("200 that is not a Responses object: %q", w.Body.Bytes())
			}
		}
	})
}

// FuzzStream feeds the SSE reader: whatever the policy streams to a chat
// completion, the client gets those bytes unchanged (the proxy records,
// never rewrites, a chat stream), the call is recorded once as a stream,
// and a stream that is not whole is recorded with an error.
func FuzzStream(f *testing.F) {
	f.Add([]byte("data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"4\"}}]}\n\n" +
		"data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"t\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n" +
		"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n"))
	f.Add([]byte("event: x\r\ndata: {\"error\":{\"message\":\"overloaded\"}}\r\n\r\n"))
	f.Add([]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"cut"))
	f.Add([]byte("data: line one\ndata: line two\n\n: comment\n\n"))
	up := &fuzzUpstream{status: http.StatusOK, contentType: "text/event-stream"}
	h, calls := fuzzProxy(f, up)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	f.Fuzz(func(t *testing.T, stream []byte) {
		up.calls, up.body = 0, stream
		w := serve(h, "/v1/chat/completions", body)
		recorded := drain(calls)
		if len(recorded) != 1 {
			t.Fatalf("%d calls recorded for one request", len(recorded))
		}
		c := recorded[0]
		if len(stream) == 0 {
			// Nothing to relay: the policy failed, and so does the call.
			if w.Code < 500 || c.Error == "" {
				t.Fatalf("an empty stream answered %d, recorded error %q", w.Code, c.Error)
			}
			return
		}
		if w.Code != http.StatusOK || !bytes.Equal(w.Body.Bytes(), stream) {
			t.Fatalf("relayed %d %q, want 200 and the stream unchanged %q", w.Code, w.Body.Bytes(), stream)
		}
		if !c.Stream {
			t.Fatal("the call is not recorded as a stream")
		}
		// Whether a chunk carried a finish reason is read by the proxy's
		// reader, as recorded, not from the bytes: a key may be written in
		// any case or with escapes (FuzzRecord holds the stream's reading to
		// the non-stream one).
		whole := bytes.Contains(stream, []byte("[DONE]")) || c.FinishReason != ""
		if !whole && c.Error == "" {
			t.Fatalf("a stream without [DONE] or a finish reason recorded without an error: %q", stream)
		}
		if strings.Contains(c.Error, "panic") {
			t.Fatalf("recorded %q", c.Error)
		}
	})
}

// FuzzRecord: a body is recorded alike whether the policy answered it
// whole or as the one chunk of a stream; both paths read it with the same
// reader. Seeds are answers as policies send them and the odd ones a
// policy may send.
func FuzzRecord(f *testing.F) {
	f.Add([]byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"4","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\\"a\\":2,\\"b\\":2}"}}]},"logprobs":{"content":[{"token":"4","logprob":-0.25,"bytes":[52],"top_logprobs":[{"token":"4","logprob":-0.25}]},{"token":"","logprob":-1e-3}]},"finish_reason":"tool_calls","token_ids":[19,2]}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}},"prompt_token_ids":[1,2,3]}`))
	f.Add([]byte(` { "id" : "sp" , "choices" : [ { "message" : null , "finish_reason" : null , "token_ids" : [ ] } , 5 ] , "usage" : null } `))
	f.Add([]byte(`{"ChoiCes":[{"fiNish_reason":"p"}]}`))
	f.Add([]byte(`{"\u0069d":"x","choices":[{"index":1,"finish_reason":"a"},{"finish_reason":"b"}]}`))
	f.Add([]byte(`{"choices":[{"token_ids":[1,"x",2147483648],"logprobs":{"content":[null,{"logprob":"-1"},{}]}}],"usage":{"prompt_tokens":1.5}}`))
	f.Add([]byte(`{"id":"a","id":"b","usage":[],"prompt_token_ids":{}}`))
	// SGLang's prompt ids are on the choice.
	f.Add([]byte(`{"choices":[{"index":0,"token_ids":[7],"prompt_token_ids":[4,5],"logprobs":{"content":[{"token":"\u00e9","logprob":-2}]}}]}`))
	whole := &fuzzUpstream{status: http.StatusOK, contentType: "application/json"}
	streamed := &fuzzUpstream{status: http.StatusOK, contentType: "text/event-stream"}
	hw, wcalls := fuzzProxy(f, whole)
	hs, scalls := fuzzProxy(f, streamed)
	f.Fuzz(func(t *testing.T, body []byte) {
		var event bytes.Buffer
		event.WriteString("data: ")
		if json.Compact(&event, body) != nil {
			return
		}
		event.WriteString("\n\n")
		whole.body, streamed.body = body, event.Bytes()
		if w := serve(hw, "/v1/chat/completions", []byte(chatBody)); w.Code != http.StatusOK {
			drain(wcalls)
			return // not an object: the non-stream call fails, as it should
		}
		serve(hs, "/v1/chat/completions", []byte(chatBody))
		got, want := drain(scalls), drain(wcalls)
		if len(got) != 1 || len(want) != 1 {
			t.Fatalf("recorded %d streamed and %d whole calls, want 1 each", len(got), len(want))
		}
		s, w := got[0], want[0]
		if s.ID != w.ID || s.FinishReason != w.FinishReason || s.Usage != w.Usage ||
			!slices.Equal(s.PromptTokenIDs, w.PromptTokenIDs) || !slices.Equal(s.CompletionTokenIDs, w.CompletionTokenIDs) ||
			!slices.Equal(s.Logprobs, w.Logprobs) || !slices.Equal(s.CompletionTokenStrings, w.CompletionTokenStrings) {
			t.Fatalf("%s recorded differently:\nstreamed %+v\nwhole    %+v", body, s, w)
		}
	})
}
