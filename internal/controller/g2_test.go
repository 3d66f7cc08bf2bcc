package controller_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// startG2 runs a G2 controller in front of policy until the test ends.
func startG2(t *testing.T, policy http.Handler, o controller.G2Options) *controller.G2 {
	t.Helper()
	o.PolicyURL = startPolicy(t, policy)
	o.Logger = quiet()
	c, err := controller.NewG2("127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, c)
	return c
}

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// post sends body to url with headers and returns the status and body.
func post(t *testing.T, url string, headers map[string]string, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(testCtx(t), http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

func TestNewG2RefusesBadOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		addr string
		o    controller.G2Options
		want string
	}{
		{"no policy", "127.0.0.1:0", controller.G2Options{}, "PolicyURL is required"},
		{"negative failures", "127.0.0.1:0", controller.G2Options{PolicyURL: "http://x/v1", FailCallbacks: -1}, "FailCallbacks"},
		{"success as failure status", "127.0.0.1:0", controller.G2Options{PolicyURL: "http://x/v1", FailStatus: 200}, "FailStatus"},
		{"bad address", "127.0.0.1:-1", controller.G2Options{PolicyURL: "http://x/v1"}, "controller.NewG2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := controller.NewG2(tc.addr, tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewG2 = %v, %v; want an error mentioning %q", c, err, tc.want)
			}
		})
	}
}

func TestG2ChatChecksAndForwards(t *testing.T) {
	type seen struct {
		header http.Header
		body   []byte
	}
	got := make(chan seen, 8)
	policy := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{r.Header.Clone(), b}
		if r.URL.Path != "/v1/chat/completions" {
			http.Error(w, "wrong path "+r.URL.Path, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)
	})
	c := startG2(t, policy, controller.G2Options{APIKey: "ctl-key"})
	url := c.ChatCompletionsURL() + "/chat/completions"
	good := map[string]string{
		"Authorization": "Bearer ctl-key", "X-Rollout-Id": "r1", "X-Sample-Id": "s1",
		"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
	}
	without := func(k string) map[string]string {
		h := map[string]string{}
		for kk, v := range good {
			if kk != k {
				h[kk] = v
			}
		}
		return h
	}
	with := func(k, v string) map[string]string {
		h := without(k)
		h[k] = v
		return h
	}
	body := `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		name    string
		headers map[string]string
		body    string
		status  int
		detail  string
	}{
		{"no bearer", without("Authorization"), body, http.StatusUnauthorized, "Invalid or missing API key"},
		{"wrong bearer", with("Authorization", "Bearer nope"), body, http.StatusUnauthorized, "Invalid or missing API key"},
		{"bare token", with("Authorization", "ctl-key"), body, http.StatusUnauthorized, "Invalid or missing API key"},
		{"no rollout id", without("X-Rollout-Id"), body, http.StatusBadRequest, "missing X-Rollout-Id header"},
		{"no sample id", without("X-Sample-Id"), body, http.StatusBadRequest, "missing X-Sample-Id header"},
		{"not JSON", good, `[1,2]`, http.StatusBadRequest, "body must be a JSON object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, _, resp := post(t, url, tc.headers, tc.body)
			var d struct{ Detail string }
			if status != tc.status || json.Unmarshal([]byte(resp), &d) != nil || d.Detail != tc.detail {
				t.Fatalf("got %d %s, want %d with detail %q", status, resp, tc.status, tc.detail)
			}
		})
	}
	if n := len(c.Chats()); n != 0 {
		t.Fatalf("refused calls were recorded: %d", n)
	}
	select {
	case s := <-got:
		t.Fatalf("a refused call reached the policy: %v", s.header)
	default:
	}

	status, _, resp := post(t, url, with("X-Mock-Fail", "500"), body)
	if status != http.StatusOK || !strings.Contains(resp, `"content":"hi"`) {
		t.Fatalf("forwarded call: %d %s", status, resp)
	}
	s := <-got
	if string(s.body) != body {
		t.Errorf("policy got body %s, want it unchanged", s.body)
	}
	for k, v := range with("X-Mock-Fail", "500") {
		if k == "Authorization" {
			if s.header.Get(k) != "" {
				t.Errorf("the controller key leaked to the policy: %q", s.header.Get(k))
			}
			continue
		}
		if s.header.Get(k) != v {
			t.Errorf("policy got %s = %q, want %q", k, s.header.Get(k), v)
		}
	}
	calls := c.Chats()
	if len(calls) != 1 || calls[0].Header.Get("X-Sample-Id") != "s1" || calls[0].Body["model"] != "openai/osmosis-rollout" {
		t.Fatalf("recorded calls = %+v", calls)
	}
}

func TestG2ChatRelaysPolicyAnswers(t *testing.T) {
	c := startG2(t, nil, controller.G2Options{})
	url := c.ChatCompletionsURL() + "/chat/completions"
	ids := map[string]string{"X-Rollout-Id": "r1", "X-Sample-Id": "s1"}
	msgs := `"messages":[{"role":"user","content":"What is 6 times 7?"}]`

	t.Run("json", func(t *testing.T) {
		status, h, resp := post(t, url, ids, `{"model":"m",`+msgs+`}`)
		if status != http.StatusOK || h.Get("Content-Type") != "application/json" || !strings.Contains(resp, `"choices"`) {
			t.Fatalf("%d %s %s", status, h.Get("Content-Type"), resp)
		}
	})
	t.Run("sse", func(t *testing.T) {
		status, h, resp := post(t, url, ids, `{"model":"m","stream":true,`+msgs+`}`)
		if status != http.StatusOK || h.Get("Content-Type") != "text/event-stream" || !strings.HasSuffix(resp, "data: [DONE]\n\n") {
			t.Fatalf("%d %s %q", status, h.Get("Content-Type"), resp)
		}
	})
	t.Run("policy error status passes through", func(t *testing.T) {
		h := map[string]string{"X-Mock-Fail": "429"}
		for k, v := range ids {
			h[k] = v
		}
		status, hdr, _ := post(t, url, h, `{"model":"m",`+msgs+`}`)
		if status != http.StatusTooManyRequests || hdr.Get("Retry-After") != "1" {
			t.Fatalf("%d Retry-After=%q", status, hdr.Get("Retry-After"))
		}
	})
}

// TestG2ChatStreamsIncrementally proves the relay flushes: the client reads
// the first event while the policy still holds the rest back.
func TestG2ChatStreamsIncrementally(t *testing.T) {
	release := make(chan struct{})
	policy := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"n\":1}\n\n")
		http.NewResponseController(w).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
	c := startG2(t, policy, controller.G2Options{})
	req, _ := http.NewRequestWithContext(testCtx(t), http.MethodPost, c.ChatCompletionsURL()+"/chat/completions",
		strings.NewReader(`{"stream":true,"messages":[{"role":"user","content":"x"}]}`))
	req.Header.Set("X-Rollout-Id", "r1")
	req.Header.Set("X-Sample-Id", "s1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil || line != "data: {\"n\":1}\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	close(release)
	rest, err := io.ReadAll(rd)
	if err != nil || string(rest) != "\ndata: [DONE]\n\n" {
		t.Fatalf("rest %q, %v", rest, err)
	}
}

func TestG2Callbacks(t *testing.T) {
	c := startG2(t, nil, controller.G2Options{APIKey: "ctl-key"})
	auth := map[string]string{"Authorization": "Bearer ctl-key"}
	malformed := 0
	const okSample = `{"id":"s1","messages":[{"role":"user","content":"q"}],"label":"42","reward":1,"remove_sample":false,"metrics":{},"extra_fields":{"k":"v"},"llm_calls":[]}`
	for _, tc := range []struct {
		name   string
		url    string
		header map[string]string
		body   string
		status int
		detail string
	}{
		{"no bearer", c.CompletionURL(), nil, `{}`, 401, "Invalid or missing API key"},
		{"not JSON", c.CompletionURL(), auth, `nope`, 422, "body must be a JSON object"},
		{"missing err_category", c.CompletionURL(), auth, `{"status":"success","rollout_id":"r","err_message":null}`, 422, "err_category: missing (send null for no value)"},
		{"empty rollout id", c.CompletionURL(), auth, `{"status":"success","rollout_id":"","err_message":null,"err_category":null}`, 422, "rollout_id: must be a non-empty string (empty only for a validation_error failure)"},
		{"empty rollout id, agent_error", c.CompletionURL(), auth, `{"status":"failure","rollout_id":"","err_message":"x","err_category":"agent_error"}`, 422, "rollout_id: must be a non-empty string (empty only for a validation_error failure)"},
		{"unknown status", c.CompletionURL(), auth, `{"status":"COMPLETED","rollout_id":"r","err_message":null,"err_category":null}`, 422, `status: "COMPLETED" is not success, failure or cancelled`},
		{"error on success", c.CompletionURL(), auth, `{"status":"success","rollout_id":"r","err_message":"x","err_category":null}`, 422, "err_message, err_category: must be null on success"},
		{"failure without message", c.CompletionURL(), auth, `{"status":"failure","rollout_id":"r","err_message":null,"err_category":"agent_error"}`, 422, "err_message: required on failure"},
		{"cancelled grader status", c.GraderURL(), auth, `{"status":"cancelled","rollout_id":"r","err_message":"x","err_category":null,"samples":{}}`, 422, `status: "cancelled" is not a grader status (success or failure)`},
		{"unknown category", c.CompletionURL(), auth, `{"status":"failure","rollout_id":"r","err_message":"x","err_category":"grader_error"}`, 422, `err_category: "grader_error" is not timeout, validation_error, http_error or agent_error`},
		{"grader without samples", c.GraderURL(), auth, `{"status":"success","rollout_id":"r","err_message":null,"err_category":null}`, 422, "samples: missing (send null for no value)"},
		{"grader null samples", c.GraderURL(), auth, `{"status":"success","rollout_id":"r","err_message":null,"err_category":null,"samples":null}`, 422, "samples: must be an object keyed by sample id"},
		{"sample id mismatch", c.GraderURL(), auth, `{"status":"success","rollout_id":"r","err_message":null,"err_category":null,"samples":{"other":` + okSample + `}}`, 422, `samples["other"].id: "s1" does not match its key`},
		{"sample field missing", c.GraderURL(), auth, `{"status":"success","rollout_id":"r","err_message":null,"err_category":null,"samples":{"s1":{"id":"s1"}}}`, 422, `samples["s1"].messages: missing`},
		{"reward on failure", c.GraderURL(), auth, `{"status":"failure","rollout_id":"r","err_message":"x","err_category":"timeout","samples":{"s1":` + okSample + `}}`, 422, `samples["s1"].reward: must be null when the rollout did not succeed`},
	} {
		if tc.status == http.StatusUnprocessableEntity {
			malformed++
		}
		t.Run(tc.name, func(t *testing.T) {
			status, _, resp := post(t, tc.url, tc.header, tc.body)
			var d struct{ Detail string }
			if status != tc.status || json.Unmarshal([]byte(resp), &d) != nil || d.Detail != tc.detail {
				t.Fatalf("got %d %s, want %d with detail %q", status, resp, tc.status, tc.detail)
			}
		})
	}
	if n := len(c.Completions("r")) + len(c.GraderCallbacks("r")); n != 0 {
		t.Fatalf("%d refused callbacks were recorded", n)
	}
	if n := len(c.Rejected()); n != malformed {
		t.Fatalf("Rejected() has %d entries, want the %d malformed bodies", n, malformed)
	}

	ctx := testCtx(t)
	status, _, resp := post(t, c.CompletionURL(), auth, `{"status":"failure","rollout_id":"r1","err_message":"boom","err_category":"agent_error"}`)
	if status != 200 || resp != `{}` {
		t.Fatalf("completion: %d %s", status, resp)
	}
	comp, err := c.WaitCompletion(ctx, "r1")
	if err != nil || comp.Status != "failure" || *comp.ErrMessage != "boom" || *comp.ErrCategory != "agent_error" ||
		comp.Header.Get("Authorization") != "Bearer ctl-key" || !bytes.Contains(comp.Raw, []byte(`"boom"`)) {
		t.Fatalf("completion = %+v, %v", comp, err)
	}

	// A start refused for its blank id reports the id as it was given.
	status, _, resp = post(t, c.CompletionURL(), auth, `{"status":"failure","rollout_id":"","err_message":"rollout_id: must not be blank","err_category":"validation_error"}`)
	if status != 200 || len(c.Completions("")) != 1 {
		t.Fatalf("validation failure with an empty rollout_id: %d %s", status, resp)
	}

	// A grader callback posted while WaitGrader waits wakes it.
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.GraderURL(),
			strings.NewReader(`{"status":"success","rollout_id":"r1","err_message":null,"err_category":null,"samples":{"s1":`+okSample+`}}`))
		req.Header.Set("Authorization", "Bearer ctl-key")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	g, err := c.WaitGrader(ctx, "r1")
	if err != nil || g.ErrMessage != nil || g.ErrCategory != nil {
		t.Fatalf("grader = %+v, %v", g, err)
	}
	s := g.Samples["s1"]
	if s.ID != "s1" || *s.Label != "42" || *s.Reward != 1 || s.RemoveSample || s.ExtraFields["k"] != "v" || len(s.Messages) != 1 || s.LLMCalls == nil {
		t.Fatalf("sample = %+v", s)
	}
	if len(c.Completions("r1")) != 1 || len(c.GraderCallbacks("r1")) != 1 {
		t.Fatalf("recorded %d completions and %d grader callbacks", len(c.Completions("r1")), len(c.GraderCallbacks("r1")))
	}

	// Cancelled may carry a message and no category.
	if status, _, resp := post(t, c.CompletionURL(), auth, `{"status":"cancelled","rollout_id":"r2","err_message":"cancelled by request","err_category":null}`); status != 200 {
		t.Fatalf("cancelled completion: %d %s", status, resp)
	}

	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	_, err = c.WaitCompletion(short, "r")
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), `"r"`) || !strings.Contains(err.Error(), "refused so far") {
		t.Fatalf("wait for a refused rollout: %v", err)
	}
}

func TestG2InjectedCallbackFailures(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		want   int
	}{
		{"default 503", 0, http.StatusServiceUnavailable},
		{"400", http.StatusBadRequest, http.StatusBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startG2(t, nil, controller.G2Options{FailCallbacks: 2, FailStatus: tc.status})
			body := `{"status":"success","rollout_id":"r1","err_message":null,"err_category":null}`
			for i := range 2 {
				if status, _, _ := post(t, c.CompletionURL(), nil, body); status != tc.want {
					t.Fatalf("post %d: %d, want %d", i+1, status, tc.want)
				}
			}
			if status, _, _ := post(t, c.CompletionURL(), nil, body); status != http.StatusOK {
				t.Fatalf("third post: %d", status)
			}
			if c.FailedCallbacks() != 2 || len(c.Completions("r1")) != 1 {
				t.Fatalf("failed %d, recorded %d", c.FailedCallbacks(), len(c.Completions("r1")))
			}
		})
	}
}

func TestG2Start(t *testing.T) {
	type got struct {
		method, path, auth string
		body               map[string]any
	}
	seen := make(chan got, 1)
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b map[string]any
		_ = json.NewDecoder(r.Body).Decode(&b)
		seen <- got{r.Method, r.URL.Path, r.Header.Get("Authorization"), b}
		w.Header().Set("Retry-After", "5")
		w.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(w, `{}`)
	}))
	t.Cleanup(server.Close)
	c := startG2(t, nil, controller.G2Options{APIKey: "ctl-key"})
	body := c.StartBody("r1", []map[string]any{{"role": "user", "content": "hi"}})
	body["label"] = "42"
	status, h, resp, err := c.Start(testCtx(t), server.URL+"/", "srv-key", body)
	if err != nil || status != http.StatusAccepted || string(resp) != `{}` || h.Get("Retry-After") != "5" {
		t.Fatalf("Start = %d %v %s %v", status, h, resp, err)
	}
	g := <-seen
	if g.method != http.MethodPost || g.path != "/rollout" || g.auth != "Bearer srv-key" {
		t.Fatalf("request %s %s auth %q", g.method, g.path, g.auth)
	}
	want := map[string]any{
		"rollout_id":              "r1",
		"chat_completions_url":    c.ChatCompletionsURL(),
		"completion_callback_url": c.CompletionURL(),
		"grader_callback_url":     c.GraderURL(),
		"controller_api_key":      "ctl-key",
		"label":                   "42",
	}
	for k, v := range want {
		if g.body[k] != v {
			t.Errorf("body[%s] = %v, want %v", k, g.body[k], v)
		}
	}
	if !strings.HasSuffix(c.ChatCompletionsURL(), "/v1") || !strings.HasPrefix(c.CompletionURL(), c.URL()) {
		t.Errorf("URLs %s %s", c.ChatCompletionsURL(), c.CompletionURL())
	}

	noKey := startG2(t, nil, controller.G2Options{})
	if _, ok := noKey.StartBody("r2", nil)["controller_api_key"]; ok {
		t.Error("StartBody sends a controller_api_key the controller does not have")
	}
	if _, _, _, err := noKey.Start(testCtx(t), "http://127.0.0.1:1", "", map[string]any{}); err == nil {
		t.Error("Start to a closed port succeeded")
	}
}

// TestG2FailFraction: with FailFraction 0.2 about a fifth of the callback
// posts, completion and grader alike, answer 503 and are not recorded.
func TestG2FailFraction(t *testing.T) {
	c := startG2(t, nil, controller.G2Options{FailFraction: 0.2})
	const n = 400
	failed := 0
	for i := range n {
		id := fmt.Sprintf("r%d", i)
		url, body := c.CompletionURL(), `{"status":"success","rollout_id":"`+id+`","err_message":null,"err_category":null}`
		recorded := func() int { return len(c.Completions(id)) }
		if i%2 == 1 {
			url, body = c.GraderURL(), `{"status":"failure","rollout_id":"`+id+`","err_message":"x","err_category":"agent_error","samples":{}}`
			recorded = func() int { return len(c.GraderCallbacks(id)) }
		}
		code, _, _ := post(t, url, nil, body)
		switch {
		case code == http.StatusOK && recorded() == 1:
		case code == http.StatusServiceUnavailable && recorded() == 0:
			failed++
		default:
			t.Fatalf("post %d: %d, %d recorded", i, code, recorded())
		}
	}
	if lo, hi := failShare(n); failed < lo || failed > hi {
		t.Errorf("%d of %d callback posts failed, want about a fifth", failed, n)
	}
	if c.FailedCallbacks() != failed {
		t.Errorf("FailedCallbacks = %d, want %d", c.FailedCallbacks(), failed)
	}
}
