package llmproxy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// members decodes a request body's top-level members.
func members(t *testing.T, body []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("upstream body is not a JSON object: %v: %s", err, body)
	}
	return m
}

// The proxy adds what rows need, and only what the client did not set.
func TestAskTokensAddsOnlyMissingMembers(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	tests := []struct {
		name string
		body string
		want map[string]string // member → value upstream; "" = absent
	}{
		{"none set", `{` + msgs + `}`,
			map[string]string{"return_token_ids": "true", "return_prompt_token_ids": "true", "logprobs": "true", "top_logprobs": ""}},
		{"client's logprobs kept", `{` + msgs + `,"logprobs":false}`,
			map[string]string{"return_token_ids": "true", "return_prompt_token_ids": "true", "logprobs": "false"}},
		{"client's top_logprobs kept", `{` + msgs + `,"logprobs":true,"top_logprobs":3}`,
			map[string]string{"return_token_ids": "true", "logprobs": "true", "top_logprobs": "3"}},
		{"client's return_token_ids kept", `{` + msgs + `,"return_token_ids":false}`,
			map[string]string{"return_token_ids": "false", "return_prompt_token_ids": "true", "logprobs": "true"}},
		{"null is missing", `{` + msgs + `,"return_token_ids":null,"logprobs":null}`,
			map[string]string{"return_token_ids": "true", "logprobs": "true"}},
		// SGLang refuses its token members on a stream; vLLM needs none.
		{"stream asks with vLLM's names", `{` + msgs + `,"stream":true}`,
			map[string]string{"return_token_ids": "true", "return_prompt_token_ids": "", "logprobs": "true"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, okJSON)
			h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
			resp, body := post(t, h.url+"/v1/chat/completions", tt.body, ids)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			h.next(t)
			got := members(t, up.only(t).body)
			for k, want := range tt.want {
				if v, ok := got[k]; want == "" && ok {
					t.Errorf("%s = %s upstream, want it absent", k, v)
				} else if want != "" && string(v) != want {
					t.Errorf("%s = %s upstream, want %s", k, v, want)
				}
			}
			if string(got["messages"]) != `[{"role":"user","content":"hi"}]` {
				t.Errorf("messages = %s upstream", got["messages"])
			}
		})
	}
}

// With AskTokens off (--training-rows=false) the body goes upstream as it came,
// and a call without ids says why.
func TestRowsOffAsksNothing(t *testing.T) {
	up := newUpstream(t, okJSON)
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	const body = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	if resp, b := post(t, h.url+"/v1/chat/completions", body, ids); resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	c := h.next(t)
	if got := string(up.only(t).body); got != body {
		t.Errorf("upstream body = %s, want the client's %s", got, body)
	}
	if !strings.Contains(c.NoTokensReason, "not asked") {
		t.Errorf("NoTokensReason = %q, want it to say the ids were not asked for", c.NoTokensReason)
	}
}

// hostedAPI answers like a hosted OpenAI-compatible API: 400 to any
// member it does not know.
func hostedAPI(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	for _, k := range []string{"return_token_ids", "return_prompt_token_ids"} {
		if strings.Contains(string(b), `"`+k+`"`) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"Unrecognized request argument supplied: `+k+`","type":"invalid_request_error","param":null,"code":null}}`)
			return
		}
	}
	okJSON(w, r)
}

// A hosted API that refuses the token members is asked again without them
// at once; the proxy remembers it, so the next call does not ask.
func TestRefusingUpstreamAskedAgainAndRemembered(t *testing.T) {
	up := newUpstream(t, hostedAPI)
	var logs logtest.Buffer
	reg := prometheus.NewRegistry()
	h := newProxy(t, llmproxy.Config{
		AskTokens: true,
		Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base + "/"}),
		Logger:    slog.New(slog.NewJSONHandler(&logs, nil)),
		Metrics:   reg,
	})

	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	if resp.StatusCode != http.StatusOK || string(body) != completionJSON {
		t.Fatalf("first call: status %d, body %s; want the upstream's answer", resp.StatusCode, body)
	}
	c := h.next(t)
	reqs := up.requests()
	if len(reqs) != 2 {
		t.Fatalf("upstream got %d requests for the first call, want 2 (asked, then without)", len(reqs))
	}
	if m := members(t, reqs[0].body); string(m["return_token_ids"]) != "true" {
		t.Errorf("first request did not ask for token ids: %s", reqs[0].body)
	}
	for _, k := range []string{"return_token_ids", "return_prompt_token_ids", "logprobs"} {
		if v, ok := members(t, reqs[1].body)[k]; ok {
			t.Errorf("the request after the refusal still has %s = %s", k, v)
		}
	}
	if c.Attempts != 2 || c.StatusCode != http.StatusOK || c.Error != "" {
		t.Errorf("record: attempts %d, status %d, error %q; want 2, 200, none", c.Attempts, c.StatusCode, c.Error)
	}
	if !strings.Contains(c.NoTokensReason, "400") || !strings.Contains(c.NoTokensReason, "Unrecognized request argument") {
		t.Errorf("NoTokensReason = %q, want the refusal's status and message", c.NoTokensReason)
	}

	// Later calls (another rollout too) ask nothing; the log said it once.
	for range 2 {
		resp, body = post(t, h.url+"/v1/chat/completions", chatBody, map[string]string{llmproxy.HeaderRolloutID: "r2", llmproxy.HeaderSampleID: "s1"})
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("later call: status %d: %s", resp.StatusCode, body)
		}
		c = h.next(t)
		if c.Attempts != 1 || !strings.HasPrefix(c.NoTokensReason, "not asked") {
			t.Errorf("later call: attempts %d, NoTokensReason %q; want 1 and a reason saying it was not asked", c.Attempts, c.NoTokensReason)
		}
	}
	if n := len(up.requests()); n != 4 {
		t.Errorf("upstream got %d requests in all, want 4", n)
	}
	const attempts = `
# HELP osmo_llmproxy_upstream_attempts_total Upstream attempts by outcome: ok, rejected (4xx passed through), tokens_refused (a 400 or 422 to a call asking for token ids, asked again without them), http_5xx, timeout, transport, malformed, too_large, aborted, paused (cut by an abort pause, made again after the resume), invalid_route.
# TYPE osmo_llmproxy_upstream_attempts_total counter
osmo_llmproxy_upstream_attempts_total{outcome="ok"} 3
osmo_llmproxy_upstream_attempts_total{outcome="tokens_refused"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(attempts), "osmo_llmproxy_upstream_attempts_total"); err != nil {
		t.Error(err)
	}
	recs, err := logs.Records()
	if err != nil {
		t.Fatal(err)
	}
	refused := 0
	for _, r := range recs {
		if msg, _ := r["msg"].(string); strings.Contains(msg, "refuses the token members") {
			refused++
			if r["rollout_id"] != "r1" {
				t.Errorf("log record without the rollout id: %v", r)
			}
		}
	}
	if refused != 1 {
		t.Errorf("the refusal was logged %d times, want once:\n%s", refused, logs.String())
	}
}

// A 400 that is the client's own (the retry without the members gets it
// too) reaches the client as the upstream sent it, and the upstream is not
// taken for one that refuses the members.
func TestClientErrorIsNotARefusal(t *testing.T) {
	const answer = `{"error":{"message":"This model's maximum context length is 8 tokens.","type":"BadRequestError","param":null,"code":400}}`
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, answer)
	})
	h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	for i := range 2 {
		resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
		if resp.StatusCode != http.StatusBadRequest || string(body) != answer {
			t.Fatalf("call %d: status %d, body %s; want the upstream's 400", i, resp.StatusCode, body)
		}
		c := h.next(t)
		if c.Attempts != 2 || c.NoTokensReason != "" || !strings.Contains(c.Error, "400") {
			t.Errorf("call %d: attempts %d, NoTokensReason %q, error %q; want 2, none, the 400", i, c.Attempts, c.NoTokensReason, c.Error)
		}
	}
	reqs := up.requests()
	if len(reqs) != 4 {
		t.Fatalf("upstream got %d requests, want 4", len(reqs))
	}
	if m := members(t, reqs[2].body); string(m["return_token_ids"]) != "true" {
		t.Errorf("the second call did not ask for token ids: %s", reqs[2].body)
	}
}

// An engine may take the members on a whole answer and refuse them on a
// stream (SGLang): a refused stream does not stop whole answers asking.
func TestStreamRefusalRememberedApart(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if strings.Contains(string(b), `"stream":true`) {
			if strings.Contains(string(b), `"return_token_ids"`) {
				w.WriteHeader(http.StatusBadRequest)
				_, _ = io.WriteString(w, `{"object":"error","message":"return_token_ids is not supported with streaming","type":"BadRequestError","code":400}`)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: "+`{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"4"},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop","token_ids":[19,2],"prompt_token_ids":[1,2]}]}`)
	})
	h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	stream := `{"stream":true,"messages":[{"role":"user","content":"hi"}]}`
	if resp, b := post(t, h.url+"/v1/chat/completions", stream, ids); resp.StatusCode != http.StatusOK {
		t.Fatalf("stream: status %d: %s", resp.StatusCode, b)
	}
	if c := h.next(t); c.Attempts != 2 || !strings.Contains(c.NoTokensReason, "not supported with streaming") {
		t.Errorf("stream: attempts %d, NoTokensReason %q", c.Attempts, c.NoTokensReason)
	}
	if resp, b := post(t, h.url+"/v1/chat/completions", chatBody, ids); resp.StatusCode != http.StatusOK {
		t.Fatalf("whole answer: status %d: %s", resp.StatusCode, b)
	}
	c := h.next(t)
	if c.Attempts != 1 || c.NoTokensReason != "" || !reflect.DeepEqual(c.PromptTokenIDs, []int32{1, 2}) || !reflect.DeepEqual(c.CompletionTokenIDs, []int32{19, 2}) {
		t.Errorf("whole answer: attempts %d, NoTokensReason %q, prompt %v, completion %v; want it asked and its ids recorded",
			c.Attempts, c.NoTokensReason, c.PromptTokenIDs, c.CompletionTokenIDs)
	}
	if resp, b := post(t, h.url+"/v1/chat/completions", stream, ids); resp.StatusCode != http.StatusOK {
		t.Fatalf("second stream: status %d: %s", resp.StatusCode, b)
	}
	if c := h.next(t); c.Attempts != 1 || !strings.HasPrefix(c.NoTokensReason, "not asked") {
		t.Errorf("second stream: attempts %d, NoTokensReason %q; want it not asked", c.Attempts, c.NoTokensReason)
	}
}

// A policy asked for ids that returns none gets a reason naming what is
// missing.
func TestAskedButNoIDs(t *testing.T) {
	up := newUpstream(t, okJSON) // ignores the members, as an old engine does
	h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	if resp, b := post(t, h.url+"/v1/chat/completions", chatBody, ids); resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	c := h.next(t)
	if want := "no prompt or completion token ids though asked for return_token_ids"; !strings.Contains(c.NoTokensReason, want) {
		t.Errorf("NoTokensReason = %q, want it to contain %q", c.NoTokensReason, want)
	}
}

// A streamed call records the same ids, logprobs and token strings as the
// same call answered whole, and the client gets the policy's answer with
// its token members.
func TestStreamedTokensEqualJSON(t *testing.T) {
	policy, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(policy)
	t.Cleanup(srv.Close)
	h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: srv.URL + "/v1"})})

	const msgs = `"messages":[{"role":"user","content":"What is 6 times 7? Answer with the number."}]`
	resp, whole := post(t, h.url+"/v1/chat/completions", `{`+msgs+`}`, ids)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, whole)
	}
	if m := members(t, whole); len(m["prompt_token_ids"]) < 3 {
		t.Errorf("the client's answer lacks the policy's prompt_token_ids: %s", whole)
	}
	j := h.next(t)
	resp, streamed := post(t, h.url+"/v1/chat/completions", `{"stream":true,`+msgs+`}`, ids)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(streamed), `"token_ids"`) {
		t.Fatalf("stream: status %d, body %s; want the policy's chunks with their token ids", resp.StatusCode, streamed)
	}
	s := h.next(t)
	if len(j.PromptTokenIDs) == 0 || len(j.CompletionTokenIDs) == 0 || j.NoTokensReason != "" {
		t.Fatalf("whole answer recorded no ids: %+v", j)
	}
	if len(j.Logprobs) != len(j.CompletionTokenIDs) || len(j.CompletionTokenStrings) != len(j.CompletionTokenIDs) {
		t.Errorf("whole answer: %d ids, %d logprobs, %d token strings; want as many of each",
			len(j.CompletionTokenIDs), len(j.Logprobs), len(j.CompletionTokenStrings))
	}
	var msg struct{ Content string }
	if err := json.Unmarshal(j.ResponseMessage, &msg); err != nil || strings.Join(j.CompletionTokenStrings, "") != msg.Content {
		t.Errorf("token strings %q do not spell the answer %s", j.CompletionTokenStrings, j.ResponseMessage)
	}
	for _, f := range []struct {
		name      string
		got, want any
	}{
		{"prompt ids", s.PromptTokenIDs, j.PromptTokenIDs},
		{"completion ids", s.CompletionTokenIDs, j.CompletionTokenIDs},
		{"logprobs", s.Logprobs, j.Logprobs},
		{"token strings", s.CompletionTokenStrings, j.CompletionTokenStrings},
		{"reason", s.NoTokensReason, j.NoTokensReason},
	} {
		if !reflect.DeepEqual(f.got, f.want) {
			t.Errorf("streamed %s = %v, want %v as answered whole", f.name, f.got, f.want)
		}
	}
}

// A stream cut mid-way records the ids that arrived, and the error.
func TestStreamCutKeepsWhatArrived(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c","prompt_token_ids":[1,2,3],"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`+"\n\n")
		_, _ = io.WriteString(w, `data: {"id":"c","choices":[{"index":0,"delta":{"content":"4"},"token_ids":[19],"logprobs":{"content":[{"token":"4","logprob":-0.5}]}}]}`+"\n\n")
		// The connection ends here: no finish, no [DONE].
	})
	h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	post(t, h.url+"/v1/chat/completions", `{"stream":true,"messages":[{"role":"user","content":"hi"}]}`, ids)
	c := h.next(t)
	want := osmo.LLMCall{PromptTokenIDs: []int32{1, 2, 3}, CompletionTokenIDs: []int32{19}, Logprobs: []float64{-0.5}, CompletionTokenStrings: []string{"4"}}
	if !reflect.DeepEqual(c.PromptTokenIDs, want.PromptTokenIDs) || !reflect.DeepEqual(c.CompletionTokenIDs, want.CompletionTokenIDs) ||
		!reflect.DeepEqual(c.Logprobs, want.Logprobs) || !reflect.DeepEqual(c.CompletionTokenStrings, want.CompletionTokenStrings) {
		t.Errorf("recorded prompt %v, completion %v, logprobs %v, strings %q; want what arrived",
			c.PromptTokenIDs, c.CompletionTokenIDs, c.Logprobs, c.CompletionTokenStrings)
	}
	if c.Error == "" {
		t.Error("a cut stream recorded no error")
	}
}

// A Responses API call is asked for tokens too: the policy receives a chat
// completion, and the record holds its ids.
func TestResponsesCallAsksTokens(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop","token_ids":[19,2],"logprobs":{"content":[{"token":"4","logprob":-0.5},{"token":"<|im_end|>","logprob":0}]}}],"prompt_token_ids":[1,2]}`)
	})
	h := newProxy(t, llmproxy.Config{AskTokens: true, Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	resp, body := post(t, h.url+"/v1/responses", `{"model":"m","input":"What is 2+2?"}`, ids)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"object":"response"`) {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	c := h.next(t)
	if m := members(t, up.only(t).body); string(m["return_token_ids"]) != "true" || string(m["logprobs"]) != "true" {
		t.Errorf("the translated request did not ask for tokens: %s", up.only(t).body)
	}
	if !reflect.DeepEqual(c.PromptTokenIDs, []int32{1, 2}) || !reflect.DeepEqual(c.CompletionTokenStrings, []string{"4", "<|im_end|>"}) || c.API != "responses" {
		t.Errorf("record: api %s, prompt %v, strings %q", c.API, c.PromptTokenIDs, c.CompletionTokenStrings)
	}
}

// BenchmarkAskTokens is the proxy's own cost per call, in memory (the
// upstream a RoundTripper answering canned bytes), with rows off and with
// rows on against a vLLM answer of 200 prompt and 24 completion tokens
// with their logprobs:
//
//	go test -run '^$' -bench AskTokens -benchmem ./pkg/llmproxy/
func BenchmarkAskTokens(b *testing.B) {
	plain := `{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is 42."},"finish_reason":"stop"}],"usage":{"prompt_tokens":200,"completion_tokens":24,"total_tokens":224}}`
	var lps, ids, prompt []string
	for i := range 24 {
		lps = append(lps, fmt.Sprintf(`{"token":" tok%d","logprob":-0.%d,"bytes":[32,116,111,107],"top_logprobs":[]}`, i, i+1))
		ids = append(ids, fmt.Sprint(1000+i))
	}
	for i := range 200 {
		prompt = append(prompt, fmt.Sprint(151644+i))
	}
	withTokens := `{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is 42."},"logprobs":{"content":[` +
		strings.Join(lps, ",") + `]},"finish_reason":"stop","token_ids":[` + strings.Join(ids, ",") + `]}],"usage":{"prompt_tokens":200,"completion_tokens":24,"total_tokens":224},"prompt_token_ids":[` +
		strings.Join(prompt, ",") + `]}`
	body := []byte(`{"model":"openai/osmosis-rollout","messages":[{"role":"system","content":"You are a calculator."},{"role":"user","content":"What is 2 + 2?"}],"temperature":1.0,"max_tokens":16}`)
	for _, tc := range []struct {
		name   string
		ask    bool
		answer string
	}{{"off", false, plain}, {"on", true, withTokens}} {
		b.Run(tc.name, func(b *testing.B) {
			p, err := llmproxy.New(llmproxy.Config{
				Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://policy.invalid/v1", Model: "policy-v1"}),
				Recorder:  llmproxy.RecorderFunc(func(context.Context, *osmo.LLMCall) {}),
				Transport: cannedUpstream(tc.answer),
				Logger:    slog.New(slog.DiscardHandler),
				AskTokens: tc.ask,
			})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
				req.Header.Set(llmproxy.HeaderRolloutID, "r1")
				req.Header.Set(llmproxy.HeaderSampleID, "s1")
				w := httptest.NewRecorder()
				p.ServeHTTP(w, req)
				if w.Code != http.StatusOK {
					b.Fatalf("status %d: %s", w.Code, w.Body)
				}
			}
		})
	}
}

// cannedUpstream answers every call with a 200 and answer.
type cannedUpstream string

func (u cannedUpstream) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	r.Body.Close()
	return &http.Response{
		StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: io.NopCloser(strings.NewReader(string(u))),
		ContentLength: int64(len(u)), Request: r,
	}, nil
}
