package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/controller"
)

// g1Stack is `osmo serve` plus `osmo mockllm` as processes and an in-test
// G1 controller, the way a training cluster would use them.
type g1Stack struct {
	base string
	ctl  *controller.Controller
	srv  *proc
}

const serverKey = "K-server"

func startG1(t *testing.T, ctlOpts controller.Options, serveArgs ...string) *g1Stack {
	t.Helper()
	return startG1Env(t, nil, ctlOpts, serveArgs...)
}

// startG1Env is startG1 with env added to osmo serve's environment.
func startG1Env(t *testing.T, env []string, ctlOpts controller.Options, serveArgs ...string) *g1Stack {
	t.Helper()
	mockAddr := startMockPolicy(t)

	ctlOpts.PolicyURL = "http://" + mockAddr + "/v1"
	ctl := startG1Controller(t, ctlOpts)

	args := append([]string{"serve", "--workflow", "calculator", "--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn"}, serveArgs...)
	env = append([]string{"OSMOSIS_ROLLOUT_CLIENT_RETRY_BASE_DELAY=0.01", "OSMOSIS_ROLLOUT_CLIENT_RETRY_MAX_DELAY=0.05"}, env...)
	srv, addrs := startListening(t, "serve", env, args...)
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")
	return &g1Stack{base: base, ctl: ctl, srv: srv}
}

func (s *g1Stack) init(t *testing.T, id string, prompt, truth string) (int, map[string]any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	code, body, err := s.ctl.Init(ctx, s.base, serverKey, controller.InitRequest{
		RolloutID:        id,
		Messages:         []map[string]any{{"role": "user", "content": prompt}},
		CompletionParams: map[string]any{"temperature": 0.7, "max_tokens": 256},
		Metadata:         map[string]any{"ground_truth": truth},
	})
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	_ = json.Unmarshal(body, &m)
	return code, m
}

func (s *g1Stack) wait(t *testing.T, id string) controller.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := s.ctl.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func do(t *testing.T, method, url, auth, body string) (int, http.Header, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatalf("%s %s: non-JSON body %q", method, url, data)
	}
	return resp.StatusCode, resp.Header, m
}

func TestG1TrainingClusterContract(t *testing.T) {
	s := startG1(t, controller.Options{APIKey: "K-controller"})

	// Health is open; platform health needs the key.
	code, _, health := do(t, "GET", s.base+"/health", "", "")
	if code != 200 || health["status"] != "healthy" || health["agent_loop"] != "calculator" {
		t.Fatalf("health %d %v", code, health)
	}
	for _, k := range []string{"active_rollouts", "completed_rollouts"} {
		if _, ok := health[k].(float64); !ok {
			t.Fatalf("health %s is not a number: %v", k, health)
		}
	}
	if len(health) != 4 {
		t.Fatalf("health has extra keys: %v", health)
	}
	if code, _, body := do(t, "GET", s.base+"/platform/health", "", ""); code != 401 || body["detail"] != "Invalid or missing API key" {
		t.Fatalf("platform health without key: %d %v", code, body)
	}
	if code, _, _ := do(t, "GET", s.base+"/platform/health", "Bearer "+serverKey, ""); code != 200 {
		t.Fatalf("platform health with key: %d", code)
	}
	if code, _, _ := do(t, "GET", s.base+"/platform/health", serverKey, ""); code != 200 {
		t.Fatalf("platform health with a bare token: %d", code)
	}

	// Init without and with a wrong key is 401 with the Osmosis body.
	initBody := fmt.Sprintf(`{"rollout_id":"x","server_url":%q,"messages":[{"role":"user","content":"What is 2 * 3?"}],"completion_params":{}}`, s.ctl.URL())
	for _, auth := range []string{"", "Bearer nope"} {
		code, _, body := do(t, "POST", s.base+"/v1/rollout/init", auth, initBody)
		if code != 401 || len(body) != 1 || body["detail"] != "Invalid or missing API key" {
			t.Fatalf("auth %q: %d %v", auth, code, body)
		}
	}

	// A batch of rollouts, each with its own task; inits are duplicated to prove idempotency.
	tasks := map[string][2]string{
		"r-1": {"What is 12 * 7?", "84"},
		"r-2": {"What is 3 + 4 * 5?", "23"},
		"r-3": {"What is (2 + 3) * 4?", "20"},
		"r-4": {"What is 9 * 9?", "80"}, // wrong ground truth: reward 0
	}
	var wg sync.WaitGroup
	for id, task := range tasks {
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				code, body := s.init(t, id, task[0], task[1])
				if code != http.StatusAccepted || body["rollout_id"] != id {
					t.Errorf("init %s: %d %v", id, code, body)
				}
				tools, _ := body["tools"].([]any)
				if len(tools) != 2 || len(body) != 2 {
					t.Errorf("init %s body: %v", id, body)
				}
			}()
		}
	}
	wg.Wait()
	for id, task := range tasks {
		c := s.wait(t, id)
		want := 1.0
		if id == "r-4" {
			want = 0
		}
		if c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != want || c.FinishReason != "stop" {
			t.Errorf("%s (%s): %s", id, task[0], c.Raw)
		}
	}
	time.Sleep(200 * time.Millisecond) // a duplicate completion would have arrived by now
	for id := range tasks {
		if n := len(s.ctl.Completions(id)); n != 1 {
			t.Errorf("%s: %d completions, want exactly 1", id, n)
		}
	}
	for _, c := range s.ctl.Chats() {
		rid := c.Header.Get("X-Rollout-Id")
		if _, ok := tasks[rid]; !ok || c.Body["rollout_id"] != rid || c.Header.Get("X-Sample-Id") == "" {
			t.Errorf("LLM call ids: header %q body %v sample %q", rid, c.Body["rollout_id"], c.Header.Get("X-Sample-Id"))
		}
		if c.Header.Get("Authorization") != "Bearer K-controller" || c.Body["temperature"] != 0.7 || c.Body["max_tokens"] != 256.0 {
			t.Errorf("LLM call auth/params: %q %v", c.Header.Get("Authorization"), c.Body)
		}
		msgs, _ := c.Body["messages"].([]any)
		if first, _ := msgs[0].(map[string]any); len(msgs) == 0 || first["role"] != "user" {
			t.Errorf("LLM call history does not start with the prompt: %v", msgs)
		}
	}

	// The sample with its recorded calls is on the REST surface.
	code, _, rec := do(t, "GET", s.base+"/v1/rollouts/r-1", "Bearer "+serverKey, "")
	samples, _ := rec["samples"].([]any)
	if code != 200 || rec["state"] != "STATE_SUCCEEDED" || len(samples) != 1 {
		t.Fatalf("GET rollout: %d %v", code, rec)
	}
	sample := samples[0].(map[string]any)
	if calls, _ := sample["llm_calls"].([]any); len(calls) != 2 || sample["reward"] != 1.0 || sample["label"] != "84" {
		t.Fatalf("sample: %v", sample)
	}
}

func TestG1BadInput(t *testing.T) {
	s := startG1(t, controller.Options{}, "--max-body-bytes", "2000000")
	auth := "Bearer " + serverKey
	valid := func(edit func(m map[string]any)) string {
		m := map[string]any{
			"rollout_id": "bad-1", "server_url": s.ctl.URL(),
			"messages":          []any{map[string]any{"role": "user", "content": "What is 2 * 2?"}},
			"completion_params": map[string]any{},
		}
		edit(m)
		b, _ := json.Marshal(m)
		return string(b)
	}
	for _, tc := range []struct {
		name, body string
		code       int
		field      string
	}{
		{"malformed JSON", `{"rollout_id": "x",`, 422, ""},
		{"missing rollout_id", valid(func(m map[string]any) { delete(m, "rollout_id") }), 422, "rollout_id"},
		{"blank rollout_id", valid(func(m map[string]any) { m["rollout_id"] = "   " }), 422, "rollout_id"},
		{"over-long rollout_id", valid(func(m map[string]any) { m["rollout_id"] = strings.Repeat("r", 300) }), 422, "rollout_id"},
		{"numeric rollout_id", valid(func(m map[string]any) { m["rollout_id"] = 7 }), 422, "rollout_id"},
		{"missing messages", valid(func(m map[string]any) { delete(m, "messages") }), 422, "messages"},
		{"message not an object", valid(func(m map[string]any) { m["messages"] = []any{"hi"} }), 422, "messages"},
		{"missing completion_params", valid(func(m map[string]any) { delete(m, "completion_params") }), 422, "completion_params"},
		{"non-object metadata", valid(func(m map[string]any) { m["metadata"] = []any{1, 2} }), 422, "metadata"},
		{"bad server_url", valid(func(m map[string]any) { m["server_url"] = "not a url" }), 422, "server_url"},
		{"oversized metadata", valid(func(m map[string]any) { m["metadata"] = map[string]any{"blob": strings.Repeat("x", 1100000)} }), 422, "metadata"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, body := do(t, "POST", s.base+"/v1/rollout/init", auth, tc.body)
			detail, _ := body["detail"].(string)
			if code != tc.code || !strings.Contains(detail, tc.field) {
				t.Fatalf("got %d %v, want %d naming %q", code, body, tc.code, tc.field)
			}
		})
	}
	t.Run("oversized body", func(t *testing.T) {
		huge := `{"rollout_id":"big","metadata":{"x":"` + strings.Repeat("y", 3<<20) + `"}}`
		req, _ := http.NewRequest("POST", s.base+"/v1/rollout/init", bytes.NewBufferString(huge))
		req.Header.Set("Authorization", auth)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("status %d, want 413", resp.StatusCode)
		}
	})
	// Still serving after all of that.
	if code, _ := s.init(t, "after-bad", "What is 5 * 5?", "25"); code != 202 {
		t.Fatalf("init after bad input: %d", code)
	}
	if c := s.wait(t, "after-bad"); c.Status != "COMPLETED" || *c.Reward != 1 {
		t.Fatalf("%s", c.Raw)
	}
}

func TestG1CallbackFailuresStillOneCompletion(t *testing.T) {
	s := startG1(t, controller.Options{FailCompletions: 2, FailStatus: 502})
	if code, _ := s.init(t, "cbf-1", "What is 6 * 6?", "36"); code != 202 {
		t.Fatal(code)
	}
	c := s.wait(t, "cbf-1")
	if c.Status != "COMPLETED" || *c.Reward != 1 || s.ctl.FailedCallbacks() != 2 {
		t.Fatalf("%s (failed %d)", c.Raw, s.ctl.FailedCallbacks())
	}
	time.Sleep(200 * time.Millisecond)
	if n := len(s.ctl.Completions("cbf-1")); n != 1 {
		t.Fatalf("%d completions", n)
	}
}

// TestServeGraderNeedsTheKey: with --api-key every grader entry point of
// osmo serve (REST /v1/grade, Connect, gRPC) refuses calls without the key,
// so nobody can grade, or plant gradings, past it; the rollouts the server
// runs itself are graded all the same.
func TestServeGraderNeedsTheKey(t *testing.T) {
	s := startG1(t, controller.Options{})
	grade := `{"rollout_id":"planted","samples":[{"id":"calculator","messages":[{"role":"assistant","content":"#### 6"}]}],"label":"6","grader":"calculator"}`
	for _, auth := range []string{"", "Bearer nope"} {
		code, _, body := do(t, "POST", s.base+"/v1/grade", auth, grade)
		if code != 401 || body["detail"] != "Invalid or missing API key" {
			t.Errorf("REST /v1/grade with auth %q: %d %v", auth, code, body)
		}
		code, _, body = do(t, "POST", s.base+"/osmo.grader.v1.GraderService/Grade", auth, grade)
		if code != 401 || body["code"] != "unauthenticated" {
			t.Errorf("Connect Grade with auth %q: %d %v", auth, code, body)
		}
	}
	conn, err := grpc.NewClient(strings.TrimPrefix(s.base, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := &graderv1.GradeRequest{RolloutId: "planted", Label: proto.String("6")}
	if _, err := graderv1.NewGraderServiceClient(conn).Grade(ctx, req); status.Code(err) != codes.Unauthenticated {
		t.Errorf("gRPC Grade without key: %v, want Unauthenticated", err)
	}
	if code, _, body := do(t, "POST", s.base+"/v1/grade", "Bearer "+serverKey, grade); code != 200 || body["rollout_id"] != "planted" {
		t.Errorf("REST /v1/grade with the key: %d %v", code, body)
	}
	// The server's own rollouts still reach the grader.
	if code, _ := s.init(t, "graded", "What is 2 * 3?", "6"); code != 202 {
		t.Fatalf("init: %d", code)
	}
	if c := s.wait(t, "graded"); c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != 1 {
		t.Errorf("completion %s", c.Raw)
	}
}
