package llmproxy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

const streamBody = `{"model":"openai/osmosis-rollout","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"add and multiply"}]}`

// toolStream is a vLLM-style stream: prompt ids on the first chunk, token
// ids and logprobs on choices, two tool calls whose deltas interleave, a
// second choice that must not leak into the record, and a usage chunk.
var toolStream = []string{
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","model":"policy-v1","prompt_token_ids":[1,2,3],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Let me "},"token_ids":[10,11],"logprobs":{"content":[{"token":"Let","logprob":-0.1,"top_logprobs":[]},{"token":" me","logprob":-0.2,"top_logprobs":[]}]}}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":1,"delta":{"content":"IGNORED"},"token_ids":[99]}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"add."},"token_ids":[12],"logprobs":{"content":[{"token":"add.","logprob":-0.3}]}}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"add","arguments":""}}]},"token_ids":[13]}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"mul","arguments":"{\"x\""}}]},"token_ids":[14]}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":1,"}}]},"token_ids":[15]}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"b\":2}"}},{"index":1,"function":{"arguments":":3}"}}]},"token_ids":[16,17]}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}`,
	`{"id":"chatcmpl-s","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":8,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":2}}}`,
	`[DONE]`,
}

const toolStreamMessage = `{"role":"assistant","content":"Let me add.","tool_calls":[
 {"id":"call_a","type":"function","function":{"name":"add","arguments":"{\"a\":1,\"b\":2}"}},
 {"id":"call_b","type":"function","function":{"name":"mul","arguments":"{\"x\":3}"}}]}`

// sseHandler streams events, flushing after each, with the given line end.
func sseHandler(eol string, events ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for _, e := range events {
			_, _ = io.WriteString(w, "data: "+e+eol+eol)
			w.(http.Flusher).Flush()
		}
	}
}

func sseText(eol string, events ...string) string {
	var b strings.Builder
	for _, e := range events {
		b.WriteString("data: " + e + eol + eol)
	}
	return b.String()
}

func TestRecordSSE(t *testing.T) {
	tests := []struct {
		name    string
		eol     string
		events  []string
		message string
		finish  string
		usage   osmo.Usage
		prompt  []int32
		tokens  []int32
		lps     []float64
	}{
		{
			name: "tool calls", eol: "\n", events: toolStream, message: toolStreamMessage, finish: "tool_calls",
			usage:  osmo.Usage{PromptTokens: 3, CompletionTokens: 8, TotalTokens: 11, CachedTokens: 2},
			prompt: []int32{1, 2, 3}, tokens: []int32{10, 11, 12, 13, 14, 15, 16, 17}, lps: []float64{-0.1, -0.2, -0.3},
		},
		{
			name: "CRLF framing", eol: "\r\n", events: toolStream, message: toolStreamMessage, finish: "tool_calls",
			usage:  osmo.Usage{PromptTokens: 3, CompletionTokens: 8, TotalTokens: 11, CachedTokens: 2},
			prompt: []int32{1, 2, 3}, tokens: []int32{10, 11, 12, 13, 14, 15, 16, 17}, lps: []float64{-0.1, -0.2, -0.3},
		},
		{
			name: "empty content is null", eol: "\n",
			events: []string{
				`{"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}`,
				`{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`,
				`[DONE]`,
			},
			message: `{"role":"assistant","content":null}`, finish: "length",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, sseHandler(tt.eol, tt.events...))
			h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1"})})
			resp, body := post(t, h.url+"/v1/chat/completions", streamBody, ids)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if want := sseText(tt.eol, tt.events...); string(body) != want {
				t.Errorf("client got\n%q\nwant the upstream stream unchanged\n%q", body, want)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
				t.Errorf("Content-Type = %q", ct)
			}
			parseServerTiming(t, resp.Header.Get("Server-Timing"))

			c := h.next(t)
			jsonEqual(t, "assembled message", c.ResponseMessage, tt.message)
			checks := []struct {
				name      string
				got, want any
			}{
				{"stream", c.Stream, true},
				{"finish", c.FinishReason, tt.finish},
				{"usage", c.Usage, tt.usage},
				{"prompt ids", c.PromptTokenIDs, tt.prompt},
				{"completion ids", c.CompletionTokenIDs, tt.tokens},
				{"logprobs", c.Logprobs, tt.lps},
				{"status", c.StatusCode, 200},
				{"err", c.Error, ""},
				{"model", c.Model, "policy-v1"},
			}
			for _, ck := range checks {
				if !equal(ck.got, ck.want) {
					t.Errorf("record %s = %v, want %v", ck.name, ck.got, ck.want)
				}
			}
			if strings.Contains(string(c.ResponseMessage), `"content"`) && tt.tokens != nil && (c.TimeToFirstTokenMS <= 0 || c.TimeToFirstTokenMS > c.LatencyMS) {
				t.Errorf("time to first token %v not within (0, latency %v]", c.TimeToFirstTokenMS, c.LatencyMS)
			}
		})
	}
}

// readEvent reads one SSE event (through its blank line).
func readEvent(t *testing.T, br *bufio.Reader) string {
	t.Helper()
	var b strings.Builder
	for {
		line, err := br.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			t.Fatalf("reading event: %v (got %q)", err, b.String())
		}
		if line == "\n" {
			return b.String()
		}
	}
}

func TestSSEChunksArriveOneByOne(t *testing.T) {
	first := `{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}`
	second := `{"id":"c","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}`
	release := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: "+first+"\n\n")
		w.(http.Flusher).Flush()
		// Hold the rest back until the client has the first chunk: a proxy
		// that buffered would never deliver it.
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: "+second+"\n\ndata: [DONE]\n\n")
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.url+"/r/r1/s/s1/v1/chat/completions", strings.NewReader(streamBody))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("no response headers while the upstream is mid-stream: %v", err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if got := readEvent(t, br); got != "data: "+first+"\n\n" {
		t.Fatalf("first event = %q", got)
	}
	close(release)
	if got := readEvent(t, br); got != "data: "+second+"\n\n" {
		t.Errorf("second event = %q", got)
	}
	if got := readEvent(t, br); got != "data: [DONE]\n\n" {
		t.Errorf("third event = %q", got)
	}
	c := h.next(t)
	jsonEqual(t, "assembled message", c.ResponseMessage, `{"role":"assistant","content":"Hello"}`)
	if c.TimeToFirstTokenMS <= 0 || c.TimeToFirstTokenMS >= c.LatencyMS {
		t.Errorf("time to first token %v, latency %v: the first chunk came before the rest", c.TimeToFirstTokenMS, c.LatencyMS)
	}
}

// hijackClose cuts the connection under a handler without finishing the response.
func hijackClose(t *testing.T, w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		t.Errorf("hijack: %v", err)
		return
	}
	conn.Close()
}

// cutWith reports whether a stream the client got is sent, then one error
// event with this code, as OpenAI's clients raise.
func cutWith(got, sent, code string) bool {
	rest, ok := strings.CutPrefix(got, sent)
	if !ok || !strings.HasPrefix(rest, "data: ") || !strings.HasSuffix(rest, "\n\n") || strings.Count(rest, "\n\n") != 1 {
		return false
	}
	var ev struct {
		Error struct {
			Message, Type, Code string
		} `json:"error"`
	}
	return json.Unmarshal([]byte(strings.TrimPrefix(rest, "data: ")), &ev) == nil &&
		ev.Error.Code == code && ev.Error.Type == "upstream_error" && ev.Error.Message != ""
}

// A stream cut inside an event: what came of it is ended before the error
// event, so the error is an event of its own.
func TestStreamCutInsideAnEvent(t *testing.T) {
	chunk := `{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}`
	for _, tail := range []string{`data: {"id":"c","cho`, "data: " + chunk + "\n"} {
		up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: "+chunk+"\n\n"+tail)
			w.(http.Flusher).Flush()
			hijackClose(t, w)
		})
		h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
		_, body := post(t, h.url+"/v1/chat/completions", streamBody, ids)
		end := "\n\n"
		if strings.HasSuffix(tail, "\n") {
			end = "\n"
		}
		if !cutWith(string(body), "data: "+chunk+"\n\n"+tail+end, "transport") {
			t.Errorf("upstream cut after %q: client got %q", tail, body)
		}
		h.next(t)
	}
}

func TestStreamBreaksMidway(t *testing.T) {
	chunk := `{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"par"}}]}`
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: "+chunk+"\n\n")
		w.(http.Flusher).Flush()
		hijackClose(t, w)
	})
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 3, BaseDelay: time.Millisecond},
	})
	resp, body := post(t, h.url+"/v1/chat/completions", streamBody, ids)
	if resp.StatusCode != http.StatusOK || !cutWith(string(body), "data: "+chunk+"\n\n", "transport") {
		t.Errorf("client got %d %q, want the first chunk then an error event", resp.StatusCode, body)
	}
	c := h.next(t)
	if c.Error == "" || !strings.Contains(c.Error, "broke") {
		t.Errorf("record error = %q, want the break noted", c.Error)
	}
	if c.Attempts != 1 || len(up.requests()) != 1 {
		t.Errorf("attempts %d, upstream requests %d: a started stream must not be retried", c.Attempts, len(up.requests()))
	}
	jsonEqual(t, "partial message", c.ResponseMessage, `{"role":"assistant","content":"par"}`)
}

func TestStreamRetriedBeforeFirstByte(t *testing.T) {
	var n atomic.Int32
	events := []string{`{"id":"c","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}`, `[DONE]`}
	ok := sseHandler("\n", events...)
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			// Headers, then nothing: the client has seen no byte yet.
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			hijackClose(t, w)
			return
		}
		ok(w, r)
	})
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 2, BaseDelay: time.Millisecond},
	})
	resp, body := post(t, h.url+"/v1/chat/completions", streamBody, ids)
	if resp.StatusCode != http.StatusOK || string(body) != sseText("\n", events...) {
		t.Errorf("client got %d %q", resp.StatusCode, body)
	}
	if c := h.next(t); c.Attempts != 2 || c.Error != "" {
		t.Errorf("record attempts %d err %q, want 2 and none", c.Attempts, c.Error)
	}
}

func TestStreamStallIsCut(t *testing.T) {
	chunk := `{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}`
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: "+chunk+"\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), Timeout: 50 * time.Millisecond})
	resp, body := post(t, h.url+"/v1/chat/completions", streamBody, ids)
	if resp.StatusCode != http.StatusOK || !cutWith(string(body), "data: "+chunk+"\n\n", "timeout") {
		t.Errorf("client got %d %q, want the first chunk then an error event", resp.StatusCode, body)
	}
	if c := h.next(t); !strings.Contains(c.Error, "stalled") {
		t.Errorf("record error = %q, want a stall", c.Error)
	}
}

func TestClientGoneMidStreamCancelsUpstream(t *testing.T) {
	chunk := `{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}`
	observed := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: "+chunk+"\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
			close(observed)
		case <-time.After(testTimeout):
		}
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.url+"/r/r1/s/s1/v1/chat/completions", strings.NewReader(streamBody))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readEvent(t, bufio.NewReader(resp.Body))
	cancel() // the agent gives up
	resp.Body.Close()
	select {
	case <-observed:
	case <-time.After(testTimeout):
		t.Fatal("the upstream call outlived its client")
	}
	if c := h.next(t); c.Error == "" || c.StatusCode != http.StatusOK {
		t.Errorf("record status %d err %q, want 200 with the abort noted", c.StatusCode, c.Error)
	}
}
