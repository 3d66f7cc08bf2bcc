package controller_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// startV03 runs a v0.3 controller in front of a mockllm policy until the
// test ends.
func startV03(t *testing.T, o controller.V03Options) *controller.V03 {
	t.Helper()
	if o.PolicyURL == "" {
		o.PolicyURL = startPolicy(t, nil)
	}
	if o.CallbackKey == "" {
		o.CallbackKey = "cb-key"
	}
	o.Logger = quiet()
	c, err := controller.NewV03("127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, c)
	return c
}

// fakeServer plays the rollout server's side of the v0.3 wire: it answers
// POST /rollout as told, then (in the background) makes one LLM call
// through the bridge and posts the callbacks that script returns.
type fakeServer struct {
	t      *testing.T
	srv    *httptest.Server
	admit  func(n int) (int, http.Header) // the n-th POST /rollout's answer (from 1)
	script func(start map[string]any) []fakePost
	posts  atomic.Int64
	mu     sync.Mutex
	starts []map[string]any
	cancel []map[string]any
	llm    []int // bridge answers
}

// fakePost is a callback the fake server posts.
type fakePost struct {
	path   string // completion or grader
	bearer string // "" means the start's controller_api_key
	body   string
}

func newFakeServer(t *testing.T) *fakeServer {
	f := &fakeServer{t: t}
	f.admit = func(int) (int, http.Header) { return http.StatusAccepted, nil }
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeServer) serve(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	_ = json.NewDecoder(r.Body).Decode(&body)
	switch r.URL.Path {
	case "/rollout/cancel":
		f.mu.Lock()
		f.cancel = append(f.cancel, body)
		f.mu.Unlock()
		_, _ = io.WriteString(w, `{"dispositions":{}}`)
	case "/rollout":
		f.mu.Lock()
		f.starts = append(f.starts, body)
		f.mu.Unlock()
		code, h := f.admit(int(f.posts.Add(1)))
		for k, v := range h {
			w.Header()[k] = v
		}
		w.WriteHeader(code)
		_, _ = io.WriteString(w, `{}`)
		if code == http.StatusAccepted && f.script != nil {
			go f.run(body)
		}
	default:
		http.NotFound(w, r)
	}
}

// run makes the rollout's LLM call and posts its callbacks.
func (f *fakeServer) run(start map[string]any) {
	llmKey, _ := start["llm_api_key"].(string)
	if llmKey == "" {
		llmKey, _ = start["controller_api_key"].(string)
	}
	code := postTo(start["chat_completions_url"].(string)+"/chat/completions", llmKey,
		`{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"What is 2 + 2?"}]}`)
	f.mu.Lock()
	f.llm = append(f.llm, code)
	f.mu.Unlock()
	for _, p := range f.script(start) {
		bearer := p.bearer
		if bearer == "" {
			bearer, _ = start["controller_api_key"].(string)
		}
		url := start["completion_callback_url"].(string)
		if p.path == "grader" {
			url = start["grader_callback_url"].(string)
		}
		postTo(url, bearer, p.body)
	}
}

func postTo(url, bearer, body string) int {
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+bearer)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

const okSampleV03 = `{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"4"}],"label":"4","reward":1,"remove_sample":false,"metrics":{},"extra_fields":{}}`

// happyScript posts a success completion and a graded sample.
func happyScript(start map[string]any) []fakePost {
	id := start["rollout_id"].(string)
	return []fakePost{
		{path: "completion", body: `{"status":"success","rollout_id":"` + id + `","err_message":null,"err_category":null}`},
		{path: "grader", body: `{"status":"success","rollout_id":"` + id + `","sample":` + okSampleV03 + `}`},
	}
}

func run(t *testing.T, c *controller.V03, f *fakeServer, id string) (controller.V03Result, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return c.Run(ctx, f.srv.URL, "server-key", controller.V03RunRequest{
		RolloutID: id, Messages: []map[string]any{{"role": "user", "content": "What is 2 + 2?"}}, Label: ptr("4"),
	})
}

func ptr[T any](v T) *T { return &v }

func TestV03RunHappy(t *testing.T) {
	for _, tc := range []struct {
		name, llmKey string
	}{{"two secrets", "llm-key"}, {"one secret", ""}} {
		t.Run(tc.name, func(t *testing.T) {
			c := startV03(t, controller.V03Options{LLMKey: tc.llmKey})
			f := newFakeServer(t)
			f.script = happyScript
			res, err := run(t, c, f, "r1")
			if err != nil {
				t.Fatal(err)
			}
			if res.Source != controller.SourceGrader || res.Status != "success" || res.Sample == nil || *res.Sample.Reward != 1 || res.Completion == nil {
				t.Fatalf("result = %+v", res)
			}
			start := f.starts[0]
			for k, want := range map[string]any{
				"rollout_id": "r1", "label": "4", "controller_api_key": "cb-key",
				"chat_completions_url":    c.URL() + "/v1/rollouts/r1",
				"completion_callback_url": c.URL() + "/v1/rollouts/r1/completion",
				"grader_callback_url":     c.URL() + "/v1/rollouts/r1/grader",
			} {
				if start[k] != want {
					t.Errorf("start %s = %v, want %v", k, start[k], want)
				}
			}
			if got, sent := start["llm_api_key"]; (tc.llmKey == "") == sent || (sent && got != tc.llmKey) {
				t.Errorf("llm_api_key = %v (sent %v), want %q", got, sent, tc.llmKey)
			}
			if f.llm[0] != http.StatusOK || len(c.Chats()) != 1 || c.Tokens("r1") == 0 {
				t.Errorf("bridge answered %v; chats %d, tokens %d", f.llm, len(c.Chats()), c.Tokens("r1"))
			}
		})
	}
}

func TestV03BridgeAuth(t *testing.T) {
	c := startV03(t, controller.V03Options{LLMKey: "llm-key", Model: "policy-v2"})
	body := `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		bearer string
		want   int
	}{{"cb-key", 401}, {"wrong", 401}, {"llm-key", 200}} {
		if got := postTo(c.ChatCompletionsURL("r")+"/chat/completions", tc.bearer, body); got != tc.want {
			t.Errorf("bearer %q: %d, want %d", tc.bearer, got, tc.want)
		}
	}
	if got := postTo(c.ChatCompletionsURL("r")+"/chat/completions", "llm-key", `[1]`); got != 400 {
		t.Errorf("a body that is not an object: %d, want 400", got)
	}
	// The call reached the policy as the configured model.
	req, _ := http.NewRequest(http.MethodPost, c.ChatCompletionsURL("r")+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer llm-key")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct {
		Model string `json:"model"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil || answer.Model != "policy-v2" {
		t.Errorf("policy answered for model %q (%v), want policy-v2", answer.Model, err)
	}
}

// TestV03CallbackChecks: the receiver refuses what the SDK's listener
// refuses, in its order.
func TestV03CallbackChecks(t *testing.T) {
	c := startV03(t, controller.V03Options{CallbackTimeout: 3 * time.Second})
	f := newFakeServer(t)
	release := make(chan struct{})
	f.script = func(map[string]any) []fakePost { <-release; return nil }
	done := make(chan error, 1)
	go func() { _, err := run(t, c, f, "r1"); done <- err }()
	deadline := time.Now().Add(3 * time.Second)
	for f.posts.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	comp, grader := c.CompletionURL("r1"), c.GraderURL("r1")
	for _, tc := range []struct {
		name, url, bearer, body string
		want                    int
	}{
		{"wrong bearer", comp, "nope", `{"status":"success"}`, 401},
		{"bad path id", c.URL() + "/v1/rollouts/r%2F1/completion", "cb-key", `{"status":"success"}`, 422},
		{"unknown status", comp, "cb-key", `{"status":"COMPLETED","rollout_id":"r1"}`, 422},
		{"id mismatch", comp, "cb-key", `{"status":"success","rollout_id":"r2"}`, 422},
		{"not terminal", comp, "cb-key", `{"status":"running","rollout_id":"r1"}`, 422},
		{"cancelled grader", grader, "cb-key", `{"status":"cancelled","rollout_id":"r1"}`, 422},
		{"pending grader", grader, "cb-key", `{"status":"pending","rollout_id":"r1"}`, 422},
		{"unknown category", comp, "cb-key", `{"status":"failure","rollout_id":"r1","err_message":"x","err_category":"grader_error"}`, 422},
		{"non-finite reward", grader, "cb-key", `{"status":"success","rollout_id":"r1","sample":{"reward":1e999}}`, 422},
		{"unknown rollout", c.CompletionURL("r9"), "cb-key", `{"status":"success"}`, 404},
	} {
		if got := postTo(tc.url, tc.bearer, tc.body); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
	if n := len(c.Rejected()); n < 6 {
		t.Errorf("%d refusals described, want at least 6: %v", n, c.Rejected())
	}
	// A v0.2-shaped grader callback (samples only) is accepted, and loses
	// the reward: v0.3 reads sample alone.
	if got := postTo(grader, "cb-key", `{"status":"success","rollout_id":"r1","samples":{"s":`+okSampleV03+`}}`); got != 200 {
		t.Fatalf("samples-only grader callback: %d", got)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if g := c.GraderCallbacks("r1"); len(g) != 1 || g[0].Sample != nil {
		t.Errorf("grader callbacks %+v, want one without a sample", g)
	}
	// Duplicates of an ended rollout are acknowledged, and counted.
	if got := postTo(grader, "cb-key", `{"status":"success","rollout_id":"r1","sample":`+okSampleV03+`}`); got != 200 {
		t.Errorf("duplicate grader callback: %d", got)
	}
	if n := len(c.GraderCallbacks("r1")); n != 2 {
		t.Errorf("%d grader callbacks recorded, want 2", n)
	}
}

func TestV03Admission(t *testing.T) {
	t.Run("429 then 202, after Retry-After", func(t *testing.T) {
		c := startV03(t, controller.V03Options{})
		f := newFakeServer(t)
		f.admit = func(n int) (int, http.Header) {
			if n == 1 {
				return http.StatusTooManyRequests, http.Header{"Retry-After": {"0.2"}}
			}
			return http.StatusAccepted, nil
		}
		f.script = happyScript
		began := time.Now()
		res, err := run(t, c, f, "r1")
		if err != nil || res.Status != "success" {
			t.Fatalf("%+v %v", res, err)
		}
		if f.posts.Load() != 2 || time.Since(began) < 200*time.Millisecond {
			t.Errorf("%d posts in %v, want the 429's Retry-After honoured", f.posts.Load(), time.Since(began))
		}
	})
	for _, code := range []int{200, 422, 500} {
		t.Run("refused with "+http.StatusText(code), func(t *testing.T) {
			c := startV03(t, controller.V03Options{})
			f := newFakeServer(t)
			f.admit = func(int) (int, http.Header) { return code, nil }
			_, err := run(t, c, f, "r1")
			var pe *controller.V03ProtocolError
			if !errors.As(err, &pe) || pe.StatusCode != code {
				t.Fatalf("err = %v, want a protocol error with %d", err, code)
			}
			// Never started: its callbacks are unknown.
			if got := postTo(c.CompletionURL("r1"), "cb-key", `{"status":"success"}`); got != 404 {
				t.Errorf("callback of a refused rollout: %d, want 404", got)
			}
		})
	}
}

func TestV03Ends(t *testing.T) {
	t.Run("callback timeout: failure, then cancel", func(t *testing.T) {
		c := startV03(t, controller.V03Options{CallbackTimeout: 200 * time.Millisecond})
		f := newFakeServer(t)
		res, err := run(t, c, f, "r1")
		if err != nil || res.Source != controller.SourceTimeout || res.Status != "failure" || *res.ErrMessage != "callback_timeout" {
			t.Fatalf("%+v %v", res, err)
		}
		if len(f.cancel) != 1 || !strings.Contains(mustJSON(t, f.cancel[0]), `"ids":["r1"]`) {
			t.Errorf("cancels %v, want one for r1", f.cancel)
		}
		if got := postTo(c.GraderURL("r1"), "cb-key", `{"status":"success","rollout_id":"r1"}`); got != 200 {
			t.Errorf("late callback: %d, want it acknowledged", got)
		}
	})
	t.Run("context ends: cancelled, then cancel", func(t *testing.T) {
		c := startV03(t, controller.V03Options{})
		f := newFakeServer(t)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		res, err := c.Run(ctx, f.srv.URL, "", controller.V03RunRequest{RolloutID: "r1"})
		if !errors.Is(err, context.DeadlineExceeded) || res.Status != "cancelled" || len(f.cancel) != 1 {
			t.Fatalf("%+v %v, cancels %v", res, err, f.cancel)
		}
	})
	t.Run("a commit that fails is retried", func(t *testing.T) {
		var mu sync.Mutex
		fails := 1
		var committed []string
		c := startV03(t, controller.V03Options{OnTerminal: func(_ context.Context, r controller.V03Result) error {
			mu.Lock()
			defer mu.Unlock()
			if fails > 0 {
				fails--
				return errors.New("disk full")
			}
			committed = append(committed, r.RolloutID)
			return nil
		}})
		f := newFakeServer(t)
		codes := make(chan int, 2)
		f.script = func(start map[string]any) []fakePost {
			g := `{"status":"success","rollout_id":"r1","sample":` + okSampleV03 + `}`
			codes <- postTo(start["grader_callback_url"].(string), "cb-key", g)
			return []fakePost{{path: "grader", body: g}}
		}
		res, err := run(t, c, f, "r1")
		if err != nil || res.Status != "success" {
			t.Fatalf("%+v %v", res, err)
		}
		if first := <-codes; first != 500 {
			t.Errorf("the callback whose commit failed got %d, want 500", first)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(committed) != 1 || len(c.GraderCallbacks("r1")) != 1 {
			t.Errorf("committed %v, grader callbacks %d; want one of each", committed, len(c.GraderCallbacks("r1")))
		}
	})
	t.Run("injected callback failures", func(t *testing.T) {
		c := startV03(t, controller.V03Options{FailCallbacks: 1})
		f := newFakeServer(t)
		f.script = func(start map[string]any) []fakePost {
			p := happyScript(start)
			return append(p[:1], p...) // the completion twice: the first is refused
		}
		res, err := run(t, c, f, "r1")
		if err != nil || res.Status != "success" || c.FailedCallbacks() != 1 || len(c.Completions("r1")) != 1 {
			t.Fatalf("%+v %v; failed %d, completions %d", res, err, c.FailedCallbacks(), len(c.Completions("r1")))
		}
	})
}

func TestNewV03RefusesBadOptions(t *testing.T) {
	for _, o := range []controller.V03Options{
		{CallbackKey: "k"},
		{PolicyURL: "http://x/v1", CallbackKey: "  "},
		{PolicyURL: "http://x/v1", CallbackKey: "k", FailCallbacks: -1},
	} {
		if _, err := controller.NewV03("127.0.0.1:0", o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestV03FailFraction: with FailFraction 0.2 about a fifth of the callback
// posts for a known rollout answer 503 and are not recorded; an unknown
// rollout's are still 404, never an injected failure.
func TestV03FailFraction(t *testing.T) {
	c := startV03(t, controller.V03Options{FailFraction: 0.2, CallbackTimeout: 30 * time.Second})
	f := newFakeServer(t)
	release := make(chan struct{})
	f.script = func(map[string]any) []fakePost { <-release; return nil }
	done := make(chan error, 1)
	var res controller.V03Result
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		res, err = c.Run(ctx, f.srv.URL, "", controller.V03RunRequest{RolloutID: "r1"})
		done <- err
	}()
	for deadline := time.Now().Add(5 * time.Second); f.posts.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("Run posted no start in 5s")
		}
	}
	const n = 400
	failed := 0
	for i := range n {
		switch code := postTo(c.CompletionURL("r1"), "cb-key", `{"status":"success","rollout_id":"r1"}`); code {
		case http.StatusOK:
		case http.StatusServiceUnavailable:
			failed++
		default:
			t.Fatalf("post %d: %d", i, code)
		}
	}
	if lo, hi := failShare(n); failed < lo || failed > hi {
		t.Errorf("%d of %d callback posts failed, want about a fifth", failed, n)
	}
	if got := len(c.Completions("r1")); got != n-failed || c.FailedCallbacks() != failed {
		t.Errorf("%d completions recorded and %d failures counted, want %d and %d", got, c.FailedCallbacks(), n-failed, failed)
	}
	for range 20 {
		if code := postTo(c.CompletionURL("r9"), "cb-key", `{"status":"success"}`); code != http.StatusNotFound {
			t.Fatalf("callback of an unknown rollout: %d, want 404", code)
		}
	}
	// The terminal callback, retried as a server would, ends the rollout.
	for attempt := 0; ; attempt++ {
		code := postTo(c.GraderURL("r1"), "cb-key", `{"status":"success","rollout_id":"r1","sample":`+okSampleV03+`}`)
		if code == http.StatusOK {
			break
		}
		if code != http.StatusServiceUnavailable || attempt == 50 {
			t.Fatalf("grader callback attempt %d: %d", attempt, code)
		}
	}
	close(release)
	if err := <-done; err != nil || res.Status != "success" {
		t.Fatalf("Run = %+v, %v", res, err)
	}
}

// TestV03RetryAdmission: with RetryAdmission a 5xx or a dropped
// connection is posted again, the rollout's callbacks staying open; an
// answer it declines is still a protocol error.
func TestV03RetryAdmission(t *testing.T) {
	retry := func(code int) bool { return code == 0 || code == http.StatusServiceUnavailable }
	t.Run("503, a dropped connection, then 202", func(t *testing.T) {
		c := startV03(t, controller.V03Options{RetryAdmission: retry})
		f := newFakeServer(t)
		f.script = happyScript
		f.admit = func(n int) (int, http.Header) {
			if n == 1 {
				return http.StatusServiceUnavailable, nil
			}
			return http.StatusAccepted, nil
		}
		// The second attempt loses its connection before any answer.
		var attempts atomic.Int64
		front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/rollout" && attempts.Add(1) == 2 {
				conn, _, err := http.NewResponseController(w).Hijack()
				if err == nil {
					_ = conn.Close()
				}
				return
			}
			f.serve(w, r)
		}))
		t.Cleanup(front.Close)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := c.Run(ctx, front.URL, "", controller.V03RunRequest{RolloutID: "r1", Label: ptr("4")})
		if err != nil || res.Status != "success" {
			t.Fatalf("Run = %+v, %v", res, err)
		}
		if got := attempts.Load(); got != 3 {
			t.Errorf("%d start attempts, want 3 (503, dropped, 202)", got)
		}
	})
	t.Run("declined: a protocol error", func(t *testing.T) {
		c := startV03(t, controller.V03Options{RetryAdmission: retry})
		f := newFakeServer(t)
		f.admit = func(int) (int, http.Header) { return http.StatusInternalServerError, nil }
		_, err := run(t, c, f, "r1")
		var pe *controller.V03ProtocolError
		if !errors.As(err, &pe) || pe.StatusCode != http.StatusInternalServerError || f.posts.Load() != 1 {
			t.Fatalf("err = %v after %d posts, want a protocol error with 500 after one", err, f.posts.Load())
		}
	})
}

// TestV03StartBody: StartBody is what Run posts.
func TestV03StartBody(t *testing.T) {
	c := startV03(t, controller.V03Options{LLMKey: "llm-key"})
	f := newFakeServer(t)
	f.script = happyScript
	req := controller.V03RunRequest{RolloutID: "r1", Messages: []map[string]any{{"role": "user", "content": "What is 2 + 2?"}},
		Label: ptr("4"), Metadata: map[string]any{"row": 1.0}, AgentTimeoutSec: ptr(30.0)}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.Run(ctx, f.srv.URL, "", req); err != nil {
		t.Fatal(err)
	}
	var want map[string]any
	if err := json.Unmarshal([]byte(mustJSON(t, c.StartBody(req))), &want); err != nil {
		t.Fatal(err)
	}
	if got := mustJSON(t, f.starts[0]); got != mustJSON(t, want) {
		t.Errorf("Run posted %s\nStartBody is %s", got, mustJSON(t, want))
	}
}
