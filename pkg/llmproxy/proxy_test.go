package llmproxy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

func TestNewValidatesConfig(t *testing.T) {
	route := llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://127.0.0.1:1/v1"})
	tests := []struct {
		name string
		cfg  llmproxy.Config
		want string
	}{
		{"no router", llmproxy.Config{}, "Router"},
		{"negative timeout", llmproxy.Config{Router: route, Timeout: -time.Second}, "Timeout"},
		{"negative body limit", llmproxy.Config{Router: route, MaxBodyBytes: -1}, "MaxBodyBytes"},
		{"negative response limit", llmproxy.Config{Router: route, MaxResponseBytes: -1}, "MaxResponseBytes"},
		{"negative retries", llmproxy.Config{Router: route, Retry: llmproxy.RetryPolicy{MaxRetries: -1}}, "MaxRetries"},
		{"negative delay", llmproxy.Config{Router: route, Retry: llmproxy.RetryPolicy{BaseDelay: -1}}, "delays"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := llmproxy.New(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New() error = %v, want one naming %q", err, tt.want)
			}
		})
	}
	if _, err := llmproxy.New(llmproxy.Config{Router: route}); err != nil {
		t.Fatalf("New(minimal config) = %v", err)
	}
}

func TestModelRewrite(t *testing.T) {
	tests := []struct {
		name        string
		body        string
		routeModel  string
		pin         bool
		wantModel   string
		wantRequest string // RequestedModel in the record
		unchanged   bool   // the upstream body must equal the client's
	}{
		{"placeholder replaced", `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"hi"}]}`, "policy-v1", false, "policy-v1", "openai/osmosis-rollout", false},
		{"missing set to route model", `{"messages":[{"role":"user","content":"hi"}]}`, "policy-v1", false, "policy-v1", "", false},
		{"null set to route model", `{"model":null,"messages":[{"role":"user","content":"hi"}]}`, "policy-v1", false, "policy-v1", "", false},
		{"missing without route model gets placeholder", `{"messages":[{"role":"user","content":"hi"}]}`, "", false, "openai/osmosis-rollout", "", false},
		{"placeholder kept without route model", `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"hi"}]}`, "", false, "openai/osmosis-rollout", "openai/osmosis-rollout", true},
		{"explicit model kept", `{"model":"gpt-x","messages":[{"role":"user","content":"hi"}]}`, "policy-v1", false, "gpt-x", "gpt-x", true},
		{"escaped placeholder replaced", `{"model":"openai\/osmosis-rollout","messages":[{"role":"user","content":"hi"}]}`, "policy-v1", false, "policy-v1", "openai/osmosis-rollout", false},
		{"pinned: explicit model routed", `{"model":"gpt-x","messages":[{"role":"user","content":"hi"}]}`, "policy-v1", true, "policy-v1", "gpt-x", false},
		{"pinned: explicit model to placeholder", `{"model":"gpt-x","messages":[{"role":"user","content":"hi"}]}`, "", true, "openai/osmosis-rollout", "gpt-x", false},
		{"pinned: placeholder kept", `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"hi"}]}`, "", true, "openai/osmosis-rollout", "openai/osmosis-rollout", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, okJSON)
			h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: tt.routeModel, PinModel: tt.pin})})
			resp, body := post(t, h.url+"/v1/chat/completions", tt.body, ids)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			got := up.only(t)
			var sent struct {
				Model string `json:"model"`
			}
			if err := json.Unmarshal(got.body, &sent); err != nil {
				t.Fatalf("upstream body is not JSON: %v: %s", err, got.body)
			}
			if sent.Model != tt.wantModel {
				t.Errorf("upstream model = %q, want %q", sent.Model, tt.wantModel)
			}
			if tt.unchanged && string(got.body) != tt.body {
				t.Errorf("upstream body = %s, want the client's unchanged %s", got.body, tt.body)
			}
			c := h.next(t)
			if c.Model != tt.wantModel || c.RequestedModel != tt.wantRequest {
				t.Errorf("record models = (requested %q, routed %q), want (%q, %q)", c.RequestedModel, c.Model, tt.wantRequest, tt.wantModel)
			}
		})
	}
}

func TestRewriteKeepsOtherFieldsVerbatim(t *testing.T) {
	up := newUpstream(t, okJSON)
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1", InjectRolloutID: true})})
	// Numbers that float64 would mangle, odd spacing, unicode escapes,
	// nested objects and a pre-existing rollout_id that must be replaced.
	fields := []string{
		`"seed": 123456789012345678901234567890`,
		`"temperature":1.0`,
		`"top_p" :0.950000000000000000001`,
		`"messages":[{"role":"user","content":"h\u00e9llo \"quoted\" {not a brace}"}]`,
		`"extra_body":{"a":[1,2.50,-0.0,1e400],"b":{"c":null}}`,
	}
	body := "{ " + fields[0] + ",\n" + `"model":"openai/osmosis-rollout",` + strings.Join(fields[1:], ",") + `,"rollout_id":"spoofed"}`
	resp, rb := post(t, h.url+"/v1/chat/completions", body, ids)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, rb)
	}
	got := string(up.only(t).body)
	for _, f := range fields {
		// Space between members may go; a value's bytes may not.
		var member bytes.Buffer
		if err := json.Compact(&member, []byte("{"+f+"}")); err != nil {
			t.Fatal(err)
		}
		want := strings.TrimSuffix(strings.TrimPrefix(member.String(), "{"), "}")
		if !strings.Contains(got, want) {
			t.Errorf("upstream body lost %s verbatim; got %s", want, got)
		}
	}
	var sent map[string]json.RawMessage
	if err := json.Unmarshal([]byte(got), &sent); err != nil {
		t.Fatalf("upstream body is not JSON: %v: %s", err, got)
	}
	if string(sent["model"]) != `"policy-v1"` || string(sent["rollout_id"]) != `"r1"` {
		t.Errorf("model, rollout_id = %s, %s; want \"policy-v1\", \"r1\"", sent["model"], sent["rollout_id"])
	}
	if n := strings.Count(got, `"rollout_id"`); n != 1 {
		t.Errorf("rollout_id appears %d times upstream, want 1: %s", n, got)
	}
	c := h.next(t)
	if want := `[{"role":"user","content":"h\u00e9llo \"quoted\" {not a brace}"}]`; mustJSON(t, c.RequestMessages) != want {
		t.Errorf("record messages = %s, want %s", c.RequestMessages, want)
	}
}

func TestInjectRolloutID(t *testing.T) {
	for _, inject := range []bool{true, false} {
		t.Run(strconv.FormatBool(inject), func(t *testing.T) {
			up := newUpstream(t, okJSON)
			h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, InjectRolloutID: inject})})
			resp, body := post(t, h.url+"/v1/chat/completions", chatBody, map[string]string{llmproxy.HeaderRolloutID: "roll-42"})
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			var sent map[string]any
			if err := json.Unmarshal(up.only(t).body, &sent); err != nil {
				t.Fatal(err)
			}
			id, ok := sent["rollout_id"]
			if inject && id != "roll-42" {
				t.Errorf("rollout_id = %v, want roll-42", id)
			}
			if !inject && ok {
				t.Errorf("rollout_id = %v injected although the route does not ask for it", id)
			}
		})
	}
}

func TestIDsAndForwardedHeaders(t *testing.T) {
	tests := []struct {
		name                  string
		path                  string
		header                map[string]string
		wantRollout, wantSamp string
	}{
		{"headers", "/v1/chat/completions", map[string]string{llmproxy.HeaderRolloutID: "r-1", llmproxy.HeaderSampleID: "agent"}, "r-1", "agent"},
		{"path", "/r/r-1/s/agent/v1/chat/completions", nil, "r-1", "agent"},
		{"path escaped", "/r/roll%2Fout%201/s/s%C3%A9/v1/chat/completions", nil, "roll/out 1", "sé"},
		{"path wins over headers", "/r/r-2/s/s-2/v1/chat/completions", map[string]string{llmproxy.HeaderRolloutID: "r-1"}, "r-2", "s-2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, okJSON)
			h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), RequireSampleID: true})
			hdr := map[string]string{
				"Traceparent":  "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
				"Tracestate":   "vendor=1",
				"Baggage":      "user=alice",
				"Accept":       "application/json",
				"X-Request-Id": "req-7",
				"X-Secret":     "must not travel",
			}
			for k, v := range tt.header {
				hdr[k] = v
			}
			resp, body := post(t, h.url+tt.path, chatBody, hdr)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			got := up.only(t)
			if got.path != "/v1/chat/completions" {
				t.Errorf("upstream path = %q", got.path)
			}
			want := map[string]string{
				"X-Rollout-Id": tt.wantRollout, "X-Sample-Id": tt.wantSamp, "Content-Type": "application/json",
				"Traceparent": hdr["Traceparent"], "Tracestate": "vendor=1", "Baggage": "user=alice",
				"Accept": "application/json", "X-Request-Id": "req-7", "X-Secret": "",
			}
			for k, v := range want {
				if g := got.header.Get(k); g != v {
					t.Errorf("upstream header %s = %q, want %q", k, g, v)
				}
			}
			c := h.next(t)
			if c.RolloutID != tt.wantRollout || c.SampleID != tt.wantSamp {
				t.Errorf("record ids = %q/%q, want %q/%q", c.RolloutID, c.SampleID, tt.wantRollout, tt.wantSamp)
			}
		})
	}
}

func TestAuthorization(t *testing.T) {
	tests := []struct {
		name       string
		route      llmproxy.Route
		clientAuth string
		wantStatus int
		wantUp     string // Authorization the upstream saw
	}{
		{"client bearer forwarded", llmproxy.Route{}, "Bearer client-key", 200, "Bearer client-key"},
		{"no auth at all", llmproxy.Route{}, "", 200, ""},
		{"api key overrides", llmproxy.Route{APIKey: "up-key"}, "Bearer client-key", 200, "Bearer up-key"},
		{"client token accepted, not forwarded", llmproxy.Route{ClientToken: "tok"}, "Bearer tok", 200, ""},
		{"client token accepted, api key sent", llmproxy.Route{ClientToken: "tok", APIKey: "up-key"}, "Bearer tok", 200, "Bearer up-key"},
		{"client token bare and lower-case scheme", llmproxy.Route{ClientToken: "tok"}, "bearer tok", 200, ""},
		{"client token missing", llmproxy.Route{ClientToken: "tok"}, "", 401, ""},
		{"client token wrong", llmproxy.Route{ClientToken: "tok"}, "Bearer tok2", 401, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, okJSON)
			tt.route.BaseURL = up.base
			h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(tt.route)})
			hdr := map[string]string{llmproxy.HeaderRolloutID: "r1"}
			if tt.clientAuth != "" {
				hdr["Authorization"] = tt.clientAuth
			}
			resp, body := post(t, h.url+"/v1/chat/completions", chatBody, hdr)
			if tt.wantStatus != http.StatusOK {
				e := decodeError(t, resp, body, tt.wantStatus)
				if e.Error.Code != "invalid_api_key" {
					t.Errorf("code = %q", e.Error.Code)
				}
				if n := len(up.requests()); n != 0 {
					t.Errorf("upstream got %d requests for an unauthorized call", n)
				}
				return
			}
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if got := up.only(t).header.Get("Authorization"); got != tt.wantUp {
				t.Errorf("upstream Authorization = %q, want %q", got, tt.wantUp)
			}
		})
	}
}

func TestRequestErrors(t *testing.T) {
	const url = "/v1/chat/completions"
	tests := []struct {
		name      string
		method    string
		path      string
		body      string
		header    map[string]string
		status    int
		code      string
		param     string
		recorded  bool
		maxBody   int64
		sampleReq bool
	}{
		{name: "missing rollout id", path: url, body: chatBody, status: 400, code: "missing_rollout_id", param: "X-Rollout-Id", recorded: true},
		{name: "unknown rollout", path: url, body: chatBody, header: map[string]string{llmproxy.HeaderRolloutID: "nope"}, status: 404, code: "unknown_rollout", param: "X-Rollout-Id", recorded: true},
		{name: "missing sample id", path: url, body: chatBody, header: map[string]string{llmproxy.HeaderRolloutID: "r1"}, status: 400, code: "missing_sample_id", param: "X-Sample-Id", recorded: true, sampleReq: true},
		{name: "control character in rollout id", path: "/r/a%0Ab/s/s1/v1/chat/completions", body: chatBody, status: 400, code: "invalid_rollout_id", param: "X-Rollout-Id", recorded: true},
		{name: "control character in sample id", path: "/r/r1/s/a%00b/v1/chat/completions", body: chatBody, status: 400, code: "invalid_sample_id", param: "X-Sample-Id", recorded: true},
		{name: "malformed JSON", path: url, body: `{"messages":[`, header: ids, status: 400, code: "invalid_json", recorded: true},
		{name: "not an object", path: url, body: `[1,2]`, header: ids, status: 400, code: "invalid_request_body", recorded: true},
		{name: "no messages", path: url, body: `{"model":"m"}`, header: ids, status: 400, code: "missing_messages", param: "messages", recorded: true},
		{name: "messages not an array", path: url, body: `{"messages":"hi"}`, header: ids, status: 400, code: "invalid_messages", param: "messages", recorded: true},
		{name: "messages empty", path: url, body: `{"messages":[]}`, header: ids, status: 400, code: "invalid_messages", param: "messages", recorded: true},
		{name: "message not an object", path: url, body: `{"messages":[{"role":"user","content":"a"}, "b"]}`, header: ids, status: 400, code: "invalid_messages", param: "messages[1]", recorded: true},
		{name: "message null", path: url, body: `{"messages":[{"role":"user"},null]}`, header: ids, status: 400, code: "invalid_messages", param: "messages[1]", recorded: true},
		{name: "messages null", path: url, body: `{"messages":null}`, header: ids, status: 400, code: "invalid_messages", param: "messages", recorded: true},
		{name: "body null", path: url, body: `null`, header: ids, status: 400, code: "invalid_request_body", recorded: true},
		{name: "model not a string", path: url, body: `{"model":7,"messages":[{"role":"user"}]}`, header: ids, status: 400, code: "invalid_model", param: "model", recorded: true},
		{name: "body too large", path: url, body: chatBody, header: ids, status: 413, code: "request_too_large", recorded: true, maxBody: 16},
		{name: "unknown path", path: "/v1/completions", body: chatBody, header: ids, status: 404, code: "not_found"},
		{name: "wrong method", method: http.MethodGet, path: url, header: ids, status: 405, code: "method_not_allowed"},
		{name: "wrong method on path form", method: http.MethodPut, path: "/r/a/s/b/v1/chat/completions", body: chatBody, status: 405, code: "method_not_allowed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, okJSON)
			routes := llmproxy.NewRouteTable()
			routes.Set("r1", llmproxy.Route{BaseURL: up.base})
			h := newProxy(t, llmproxy.Config{Router: routes, MaxBodyBytes: tt.maxBody, RequireSampleID: tt.sampleReq})

			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			method := tt.method
			if method == "" {
				method = http.MethodPost
			}
			req, _ := http.NewRequestWithContext(ctx, method, h.url+tt.path, strings.NewReader(tt.body))
			for k, v := range tt.header {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()

			e := decodeError(t, resp, body, tt.status)
			if e.Error.Code != tt.code {
				t.Errorf("code = %q, want %q (%s)", e.Error.Code, tt.code, e.Error.Message)
			}
			if got := deref(e.Error.Param); got != tt.param {
				t.Errorf("param = %q, want %q", got, tt.param)
			}
			if resp.Header.Get("Server-Timing") == "" {
				t.Error("no Server-Timing header on an error")
			}
			if n := len(up.requests()); n != 0 {
				t.Errorf("upstream got %d requests for a rejected call", n)
			}
			if tt.recorded {
				c := h.next(t)
				if c.StatusCode != tt.status || c.Error == "" {
					t.Errorf("record status %d err %q, want %d with an error", c.StatusCode, c.Error, tt.status)
				}
			}
		})
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func TestRecordJSON(t *testing.T) {
	const answer = `{"id":"chatcmpl-9","object":"chat.completion","model":"policy-v1",
	"prompt_token_ids":[1,2,3],
	"choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"add","arguments":"{\"a\":2,\"b\":2}"}}]},
	  "finish_reason":"tool_calls","token_ids":[7,8],
	  "logprobs":{"content":[{"token":"a","logprob":-0.25,"top_logprobs":[]},{"token":"b","logprob":-1.5,"top_logprobs":[]}]}}],
	"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}}`
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		_, _ = io.WriteString(w, answer)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1"})})
	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	if resp.StatusCode != http.StatusOK || string(body) != answer {
		t.Fatalf("client got %d %s, want the upstream body unchanged", resp.StatusCode, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json; charset=utf-8" {
		t.Errorf("Content-Type = %q", ct)
	}
	c := h.next(t)
	jsonEqual(t, "response message", c.ResponseMessage, `{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"add","arguments":"{\"a\":2,\"b\":2}"}}]}`)
	jsonEqual(t, "request messages", []byte(mustJSON(t, c.RequestMessages)), `[{"role":"user","content":"What is 2+2?"}]`)
	checks := []struct {
		name      string
		got, want any
	}{
		{"id", c.ID, "chatcmpl-9"},
		{"finish", c.FinishReason, "tool_calls"},
		{"usage", c.Usage, osmo.Usage{PromptTokens: 3, CompletionTokens: 2, TotalTokens: 5, CachedTokens: 1}},
		{"prompt ids", c.PromptTokenIDs, []int32{1, 2, 3}},
		{"completion ids", c.CompletionTokenIDs, []int32{7, 8}},
		{"logprobs", c.Logprobs, []float64{-0.25, -1.5}},
		{"status", c.StatusCode, 200},
		{"attempts", c.Attempts, 1},
		{"stream", c.Stream, false},
		{"err", c.Error, ""},
	}
	for _, ck := range checks {
		if !equal(ck.got, ck.want) {
			t.Errorf("record %s = %v, want %v", ck.name, ck.got, ck.want)
		}
	}
	if c.LatencyMS <= 0 || c.StartedAt.IsZero() {
		t.Errorf("record latency %v, started %v", c.LatencyMS, c.StartedAt)
	}
}

func equal(a, b any) bool {
	switch a := a.(type) {
	case []int32:
		return slices.Equal(a, b.([]int32))
	case []float64:
		return slices.Equal(a, b.([]float64))
	}
	return a == b
}

func TestRetryOn5xxThenSuccess(t *testing.T) {
	var n atomic.Int32
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		switch n.Add(1) {
		case 1:
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
		case 2:
			http.Error(w, "boom", http.StatusInternalServerError)
		default:
			okJSON(w, r)
		}
	})
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 3, BaseDelay: time.Millisecond, MaxDelay: 5 * time.Millisecond},
	})
	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	if resp.StatusCode != http.StatusOK || string(body) != completionJSON {
		t.Fatalf("got %d %s", resp.StatusCode, body)
	}
	if got := len(up.requests()); got != 3 {
		t.Errorf("upstream got %d requests, want 3", got)
	}
	if c := h.next(t); c.Attempts != 3 || c.StatusCode != 200 || c.Error != "" {
		t.Errorf("record attempts %d status %d err %q, want 3, 200, none", c.Attempts, c.StatusCode, c.Error)
	}
	if st := resp.Header.Get("Server-Timing"); !strings.Contains(st, "backoff;dur=") {
		t.Errorf("Server-Timing %q does not show the retry backoff", st)
	}
}

func TestUpstreamFailures(t *testing.T) {
	hang := func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }
	tests := []struct {
		name     string
		handler  http.HandlerFunc
		retries  int
		status   int
		code     string
		contains []string
		requests int
	}{
		{
			name: "4xx passed through at once",
			handler: func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Retry-After", "7")
				http.Error(w, `{"error":"slow down"}`, http.StatusTooManyRequests)
			},
			retries:  3,
			status:   429,
			requests: 1,
		},
		{
			name:     "5xx retried then 502",
			handler:  func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "engine dead", 500) },
			retries:  2,
			status:   502,
			code:     "upstream_error",
			contains: []string{"3 attempt", "500", "engine dead"},
			requests: 3,
		},
		{
			name:     "hang is 504 after per-attempt timeouts",
			handler:  hang,
			retries:  2,
			status:   504,
			code:     "upstream_timeout",
			contains: []string{"3 attempt", "timeout"},
			requests: 3,
		},
		{
			name: "malformed JSON 200 is 502",
			handler: func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, `{"id": "x", "choices": [`)
			},
			retries:  1,
			status:   502,
			code:     "upstream_malformed_response",
			contains: []string{"2 attempt", "200", "malformed", `{"id": "x"`},
			requests: 2,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, tt.handler)
			h := newProxy(t, llmproxy.Config{
				Router:  llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}),
				Retry:   llmproxy.RetryPolicy{MaxRetries: tt.retries, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond},
				Timeout: 50 * time.Millisecond,
			})
			resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
			c := h.next(t)
			if got := len(up.requests()); got != tt.requests {
				t.Errorf("upstream got %d requests, want %d", got, tt.requests)
			}
			if c.Attempts != tt.requests || c.StatusCode != tt.status || c.Error == "" {
				t.Errorf("record attempts %d status %d err %q", c.Attempts, c.StatusCode, c.Error)
			}
			if tt.code == "" { // passed through
				if resp.StatusCode != tt.status || string(body) != "{\"error\":\"slow down\"}\n" || resp.Header.Get("Retry-After") != "7" {
					t.Errorf("client got %d %q Retry-After %q, want the upstream answer unchanged", resp.StatusCode, body, resp.Header.Get("Retry-After"))
				}
				return
			}
			e := decodeError(t, resp, body, tt.status)
			if e.Error.Code != tt.code {
				t.Errorf("code = %q, want %q", e.Error.Code, tt.code)
			}
			for _, s := range tt.contains {
				if !strings.Contains(e.Error.Message, s) {
					t.Errorf("message %q does not mention %q", e.Error.Message, s)
				}
			}
		})
	}
}

func TestUnreachableUpstream(t *testing.T) {
	// A listener closed at once: every attempt is refused.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://" + addr + "/v1"}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 1, BaseDelay: time.Millisecond},
	})
	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	e := decodeError(t, resp, body, http.StatusBadGateway)
	if e.Error.Code != "upstream_unreachable" || !strings.Contains(e.Error.Message, "2 attempt") {
		t.Errorf("error = %+v", e.Error)
	}
}

// refusedError is a transport error retrying cannot fix, as an outbound
// address policy's refusal is.
type refusedError struct{}

func (refusedError) Error() string   { return "outbound address 169.254.169.254 denied" }
func (refusedError) Permanent() bool { return true }

// TestPermanentTransportErrorNotRetried: a transport error that says it is
// permanent fails the call after one attempt, with its reason.
func TestPermanentTransportErrorNotRetried(t *testing.T) {
	var attempts atomic.Int32
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://169.254.169.254/v1"}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 3, BaseDelay: time.Millisecond},
		Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
			attempts.Add(1)
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: refusedError{}}
		}),
	})
	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	e := decodeError(t, resp, body, http.StatusBadGateway)
	if e.Error.Code != "upstream_unreachable" || !strings.Contains(e.Error.Message, "1 attempt") || !strings.Contains(e.Error.Message, "denied") {
		t.Errorf("error = %+v", e.Error)
	}
	if n := attempts.Load(); n != 1 {
		t.Errorf("%d attempts, want 1", n)
	}
}

// The same on the last try allowed (no retries): a 502, not a dropped
// connection.
func TestPermanentTransportErrorOnTheLastTry(t *testing.T) {
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://169.254.169.254/v1"}),
		Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: refusedError{}}
		}),
	})
	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	if e := decodeError(t, resp, body, http.StatusBadGateway); e.Error.Code != "upstream_unreachable" {
		t.Errorf("error = %+v", e.Error)
	}
	if c := h.next(t); c.StatusCode != http.StatusBadGateway || c.Attempts != 1 {
		t.Errorf("recorded status %d, %d attempts", c.StatusCode, c.Attempts)
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestRouteContextCancelAbortsCall(t *testing.T) {
	started := make(chan struct{})
	observed := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		close(started)
		select {
		case <-r.Context().Done():
			close(observed)
		case <-time.After(testTimeout):
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Context: ctx}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 3, BaseDelay: time.Millisecond},
	})
	go func() {
		select {
		case <-started:
			cancel()
		case <-time.After(testTimeout):
		}
	}()
	resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	select {
	case <-observed:
	case <-time.After(testTimeout):
		t.Fatal("the upstream never saw its request context end")
	}
	e := decodeError(t, resp, body, http.StatusServiceUnavailable)
	if e.Error.Code != "rollout_ended" {
		t.Errorf("code = %q", e.Error.Code)
	}
	if c := h.next(t); c.Attempts != 1 || c.StatusCode != 503 {
		t.Errorf("record attempts %d status %d; want 1 attempt (no retry after cancel), 503", c.Attempts, c.StatusCode)
	}

	// Once the rollout is over, calls are refused without reaching upstream.
	resp, body = post(t, h.url+"/v1/chat/completions", chatBody, ids)
	decodeError(t, resp, body, http.StatusServiceUnavailable)
	if n := len(up.requests()); n != 1 {
		t.Errorf("upstream got %d requests, want 1", n)
	}
}

var serverTimingRE = regexp.MustCompile(`^proxy;dur=(\d+\.\d{3}), upstream;dur=(\d+\.\d{3})`)

// parseServerTiming returns the proxy and upstream durations in ms.
func parseServerTiming(t *testing.T, v string) (proxy, upstream float64) {
	t.Helper()
	m := serverTimingRE.FindStringSubmatch(v)
	if m == nil {
		t.Fatalf("Server-Timing = %q, want proxy;dur=..., upstream;dur=...", v)
	}
	proxy, _ = strconv.ParseFloat(m[1], 64)
	upstream, _ = strconv.ParseFloat(m[2], 64)
	return proxy, upstream
}

func TestServerTiming(t *testing.T) {
	const delay = 20 * time.Millisecond
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(delay)
		okJSON(w, r)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	resp, _ := post(t, h.url+"/v1/chat/completions", chatBody, ids)
	proxy, upstream := parseServerTiming(t, resp.Header.Get("Server-Timing"))
	if upstream < float64(delay.Milliseconds()) {
		t.Errorf("upstream;dur=%.3f, want at least the upstream's %v", upstream, delay)
	}
	if proxy >= upstream {
		t.Errorf("proxy;dur=%.3f counts the upstream wait (upstream;dur=%.3f)", proxy, upstream)
	}
}

func TestChunkedRequestBody(t *testing.T) {
	tests := []struct {
		name    string
		maxBody int64
		status  int
	}{
		{"within limit", 1 << 10, http.StatusOK},
		{"over limit", 32, http.StatusRequestEntityTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newUpstream(t, okJSON)
			h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), MaxBodyBytes: tt.maxBody})
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			// A reader of unknown length makes the client send the body chunked.
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.url+"/r/r1/s/s1/v1/chat/completions", io.MultiReader(strings.NewReader(chatBody)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.status, body)
			}
			if tt.status == http.StatusOK && string(up.only(t).body) != chatBody {
				t.Errorf("upstream body = %s", up.only(t).body)
			}
		})
	}
}

func TestUpstreamResponseLimitAndBadRoute(t *testing.T) {
	up := newUpstream(t, okJSON)
	bigEvent := newUpstream(t, sseHandler("\n", `{"id":"c","choices":[{"index":0,"delta":{"content":"`+strings.Repeat("x", 100)+`"}}]}`))
	tests := []struct {
		name   string
		route  llmproxy.Route
		max    int64
		status int
		code   string
	}{
		{"response over limit", llmproxy.Route{BaseURL: up.base}, 64, http.StatusBadGateway, "upstream_response_too_large"},
		{"stream event over limit", llmproxy.Route{BaseURL: bigEvent.base}, 64, http.StatusBadGateway, "upstream_response_too_large"},
		{"unusable base URL", llmproxy.Route{BaseURL: "http://[::1"}, 0, http.StatusInternalServerError, "invalid_route"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newProxy(t, llmproxy.Config{
				Router:           llmproxy.StaticRouter(tt.route),
				MaxResponseBytes: tt.max,
				Retry:            llmproxy.RetryPolicy{MaxRetries: 2, BaseDelay: time.Millisecond},
			})
			resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
			e := decodeError(t, resp, body, tt.status)
			if e.Error.Code != tt.code {
				t.Errorf("code = %q, want %q (%s)", e.Error.Code, tt.code, e.Error.Message)
			}
			if c := h.next(t); c.Attempts != 1 {
				t.Errorf("attempts = %d; a limit or a bad route is not worth retrying", c.Attempts)
			}
		})
	}
}

func TestLogsCarryIDs(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "down", http.StatusServiceUnavailable) })
	var logs logtest.Buffer
	h := newProxy(t, llmproxy.Config{
		Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}),
		Retry:  llmproxy.RetryPolicy{MaxRetries: 1, BaseDelay: time.Millisecond},
		Logger: slog.New(slog.NewJSONHandler(&logs, nil)),
	})
	post(t, h.url+"/v1/chat/completions", chatBody, ids)
	h.next(t)
	var levels []string
	for line := range strings.Lines(logs.String()) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec["rollout_id"] != "r1" || rec["sample_id"] != "s1" {
			t.Errorf("log record lacks the ids: %s", line)
		}
		levels = append(levels, rec["level"].(string)+" "+rec["msg"].(string))
	}
	want := []string{"WARN llmproxy: retrying upstream call", "WARN llmproxy: call failed"}
	if !slices.Equal(levels, want) {
		t.Errorf("logs = %q, want %q", levels, want)
	}
}

// TestDefaultTransport: each call is a transport of its own (closing one's
// idle connections leaves another's), with compression off so SSE events
// are not held back in a compressor.
func TestDefaultTransport(t *testing.T) {
	a, b := llmproxy.DefaultTransport(), llmproxy.DefaultTransport()
	if a == b {
		t.Fatal("DefaultTransport returned the same transport twice")
	}
	if !a.DisableCompression || a.MaxIdleConnsPerHost < 100 {
		t.Errorf("DefaultTransport: compression off %v, %d idle connections per host; want compression off and at least 100",
			a.DisableCompression, a.MaxIdleConnsPerHost)
	}
}
