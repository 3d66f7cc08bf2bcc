//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/controller"
)

// g2Stack is `osmo serve` with a G2 workflow plus `osmo mockllm` as
// processes and an in-test G2 controller between them and the policy.
type g2Stack struct {
	base string
	ctl  *controller.G2
	srv  *proc
}

const controllerKey = "K-controller"

func startG2(t *testing.T, mockArgs []string, env []string, serveArgs ...string) *g2Stack {
	t.Helper()
	mockAddr := startMockPolicy(t, mockArgs...)

	ctl, err := controller.NewG2("127.0.0.1:0", controller.G2Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: controllerKey, Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)

	args := append([]string{"serve", "--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn"}, serveArgs...)
	srv, addrs := startListening(t, "serve", env, args...)
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")
	return &g2Stack{base: base, ctl: ctl, srv: srv}
}

// startRollout posts a G2 start for prompt with label and returns the answer.
func (s *g2Stack) startRollout(t *testing.T, id, prompt string, label any, extra map[string]any) (int, []byte) {
	t.Helper()
	body := s.ctl.StartBody(id, []map[string]any{{"role": "user", "content": prompt}})
	body["label"] = label
	body["metadata"] = map[string]any{"row": id}
	body["agent_timeout_sec"] = 120
	for k, v := range extra {
		body[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	code, _, data, err := s.ctl.Start(ctx, s.base, serverKey, body)
	if err != nil {
		t.Fatal(err)
	}
	return code, data
}

func (s *g2Stack) callbacks(t *testing.T, id string) (controller.G2Callback, controller.G2Callback) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	comp, err := s.ctl.WaitCompletion(ctx, id)
	if err != nil {
		t.Fatalf("%s: no completion callback: %v\nserver output:\n%s", id, err, s.srv.Output())
	}
	grade, err := s.ctl.WaitGrader(ctx, id)
	if err != nil {
		t.Fatalf("%s: no grader callback: %v\nserver output:\n%s", id, err, s.srv.Output())
	}
	return comp, grade
}

// onlyOnce fails unless each callback of id arrived exactly once (after a
// short wait for strays).
func (s *g2Stack) onlyOnce(t *testing.T, id string) {
	t.Helper()
	time.Sleep(200 * time.Millisecond)
	if n, m := len(s.ctl.Completions(id)), len(s.ctl.GraderCallbacks(id)); n != 1 || m != 1 {
		t.Errorf("%s: %d completion and %d grader callbacks, want exactly 1 each", id, n, m)
	}
}

// TestG2MultiplyContract drives `osmo serve --workflow multiply --grader
// multiply` as a G2 controller written from PROTOCOL.md would.
func TestG2MultiplyContract(t *testing.T) {
	s := startG2(t, nil, nil, "--workflow", "multiply", "--grader", "multiply")

	for _, tc := range []struct {
		id, label string
		want      float64
	}{{"mul-right", "42", 1}, {"mul-wrong", "41", 0}} {
		code, data := s.startRollout(t, tc.id, "What is 6 times 7?", tc.label, map[string]any{"extra_fields": map[string]any{"dataset": "mul"}})
		if code != 202 || strings.TrimSpace(string(data)) != "{}" {
			t.Fatalf("%s: POST /rollout = %d %s, want 202 {}", tc.id, code, data)
		}
		comp, grade := s.callbacks(t, tc.id)
		if comp.Status != "success" || comp.ErrMessage != nil || comp.ErrCategory != nil {
			t.Errorf("%s: completion %s, want success with null errors", tc.id, comp.Raw)
		}
		if got := comp.Header.Get("Authorization"); got != "Bearer "+controllerKey {
			t.Errorf("%s: completion Authorization %q", tc.id, got)
		}
		sample, ok := grade.Samples["multiply-agent"]
		if grade.Status != "success" || !ok || len(grade.Samples) != 1 {
			t.Fatalf("%s: grader callback %s, want success with sample multiply-agent", tc.id, grade.Raw)
		}
		if sample.Reward == nil || *sample.Reward != tc.want || math.IsNaN(*sample.Reward) {
			t.Errorf("%s: reward %v, want %v", tc.id, sample.Reward, tc.want)
		}
		if sample.Label == nil || *sample.Label != tc.label {
			t.Errorf("%s: sample label %v, want %q", tc.id, sample.Label, tc.label)
		}
		if sample.ExtraFields["dataset"] != "mul" {
			t.Errorf("%s: extra_fields %v lost the request's", tc.id, sample.ExtraFields)
		}
		roles := []string{}
		for _, m := range sample.Messages {
			roles = append(roles, fmt.Sprint(m["role"]))
		}
		if got := strings.Join(roles, ","); got != "system,user,assistant,tool,assistant" {
			t.Errorf("%s: message roles %s, want system,user,assistant,tool,assistant", tc.id, got)
		}
		if len(sample.LLMCalls) != 2 {
			t.Errorf("%s: %d llm_calls, want 2", tc.id, len(sample.LLMCalls))
		}
		s.onlyOnce(t, tc.id)

		code, _, st := do(t, "GET", s.base+"/rollout/"+tc.id+"/status", "Bearer "+serverKey, "")
		if code != 200 || st["status"] != "success" || st["reward"] != tc.want {
			t.Errorf("%s: status %d %v", tc.id, code, st)
		}
	}

	// Every LLM call reached the controller as PROTOCOL.md says.
	chats := s.ctl.Chats()
	if len(chats) != 4 {
		t.Fatalf("controller saw %d LLM calls, want 4", len(chats))
	}
	for _, c := range chats {
		if c.Header.Get("X-Sample-Id") != "multiply-agent" || !strings.HasPrefix(c.Header.Get("X-Rollout-Id"), "mul-") {
			t.Errorf("LLM call ids: x-rollout-id %q x-sample-id %q", c.Header.Get("X-Rollout-Id"), c.Header.Get("X-Sample-Id"))
		}
		if c.Header.Get("Authorization") != "Bearer "+controllerKey {
			t.Errorf("LLM call Authorization %q, want the controller_api_key", c.Header.Get("Authorization"))
		}
		if c.Body["model"] != "openai/osmosis-rollout" {
			t.Errorf("LLM call model %v", c.Body["model"])
		}
		if strings.Contains(fmt.Sprint(c.Body["messages"]), "41") {
			t.Errorf("the label reached the workflow's LLM call: %v", c.Body["messages"])
		}
	}

	code, _, h := do(t, "GET", s.base+"/health", "", "")
	if conc, _ := h["concurrency"].(map[string]any); code != 200 || h["status"] != "ok" || conc["max_concurrent"] != float64(100) {
		t.Errorf("health %d %v", code, h)
	}
	code, _, st := do(t, "GET", s.base+"/rollout/never-started/status", "Bearer "+serverKey, "")
	if code != 200 || st["status"] != "unknown" {
		t.Errorf("unknown id: %d %v", code, st)
	}

	// Bad input: 422 naming the field at once, and the refusal also reaches
	// the callbacks (those with a usable URL) as one validation_error
	// failure carrying the same message.
	refused := map[string]string{} // rollout id as sent -> the 422's detail
	for _, tc := range []struct {
		name  string
		patch map[string]any
		field string
	}{
		{"blank id", map[string]any{"rollout_id": "  "}, "rollout_id"},
		{"slash", map[string]any{"rollout_id": "a/b"}, "rollout_id"},
		{"dotdot", map[string]any{"rollout_id": ".."}, "rollout_id"},
		{"empty key", map[string]any{"controller_api_key": ""}, "controller_api_key"},
		{"negative timeout", map[string]any{"agent_timeout_sec": -1}, "agent_timeout_sec"},
		{"no callback url", map[string]any{"completion_callback_url": nil}, "completion_callback_url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := s.ctl.StartBody("bad-"+strings.ReplaceAll(tc.name, " ", "-"), nil)
			for k, v := range tc.patch {
				body[k] = v
			}
			b, _ := json.Marshal(body)
			code, _, resp := do(t, "POST", s.base+"/rollout", "Bearer "+serverKey, string(b))
			detail, _ := resp["detail"].(string)
			if code != 422 || !strings.HasPrefix(detail, tc.field+":") {
				t.Errorf("POST /rollout = %d %v, want 422 naming %s", code, resp, tc.field)
			}
			refused[body["rollout_id"].(string)] = detail
		})
	}
	// Without the server's key nothing is posted anywhere.
	unauth := s.ctl.StartBody("bad-unauthenticated", nil)
	unauth["agent_timeout_sec"] = -1
	b, _ := json.Marshal(unauth)
	if code, _, resp := do(t, "POST", s.base+"/rollout", "", string(b)); code != 401 {
		t.Errorf("unauthenticated bad start: %d %v, want 401", code, resp)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, id := range []string{"  ", "a/b", "..", "bad-negative-timeout"} {
		for kind, wait := range map[string]func(context.Context, string) (controller.G2Callback, error){"completion": s.ctl.WaitCompletion, "grader": s.ctl.WaitGrader} {
			cb, err := wait(ctx, id)
			if err != nil {
				t.Fatalf("%q: no %s callback for the refused start: %v", id, kind, err)
			}
			if cb.Status != "failure" || cb.ErrCategory == nil || *cb.ErrCategory != "validation_error" || cb.ErrMessage == nil || *cb.ErrMessage != refused[id] {
				t.Errorf("%q: %s callback %s, want the validation_error failure %q", id, kind, cb.Raw, refused[id])
			}
		}
	}
	if _, err := s.ctl.WaitGrader(ctx, "bad-no-callback-url"); err != nil {
		t.Errorf("no grader callback for a start refused for its completion_callback_url: %v", err)
	}
	time.Sleep(200 * time.Millisecond)
	for _, id := range []string{"  ", "a/b", "..", "bad-negative-timeout", "bad-no-callback-url", "bad-empty-key", "bad-unauthenticated"} {
		wantC, wantG := 1, 1
		switch id {
		case "bad-no-callback-url":
			wantC = 0
		case "bad-empty-key", "bad-unauthenticated":
			// No key to bear (the controller refuses such callbacks), and
			// no callback at all for a caller without the server's key.
			wantC, wantG = 0, 0
		}
		if n, m := len(s.ctl.Completions(id)), len(s.ctl.GraderCallbacks(id)); n != wantC || m != wantG {
			t.Errorf("%q: %d completions and %d grader callbacks, want %d and %d", id, n, m, wantC, wantG)
		}
	}
}

// TestG2ExecAgents runs unmodified framework programs as --exec workflows:
// each comes back as a graded sample in its framework's own shape.
func TestG2ExecAgents(t *testing.T) {
	for _, a := range []struct {
		name  string
		argv  func(t *testing.T) []string
		shape func(t *testing.T, msgs []map[string]any)
		// api is the API the program calls; stream whether it streams.
		api    string
		stream bool
	}{
		{"openai-agents", tsx("openai-agents.ts"), hasItemType("function_call"), "chat.completions", false},
		{"strands", tsx("strands.ts"), hasBlock("toolUse"), "chat.completions", true},
		{"python-stdlib", python("python-stdlib/agent.py"), hasRole("tool"), "chat.completions", false},
		// The frameworks' defaults: the Responses API, models of their own.
		{"openai-agents-defaults", tsx("defaults-openai-agents.ts"), hasItemType("function_call"), "responses", false},
		{"openai-agents-defaults-stream", tsx("defaults-openai-agents.ts", "--stream"), hasItemType("function_call"), "responses", true},
		{"strands-defaults", tsx("defaults-strands.ts"), hasBlock("toolUse"), "responses", true},
	} {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			argv := a.argv(t)
			s := startG2(t, nil, nil, "--exec", strings.Join(argv, " "), "--grader", "multiply")
			id := "exec-" + a.name
			if code, data := s.startRollout(t, id, "What is 6 times 7?", "42", nil); code != 202 {
				t.Fatalf("POST /rollout = %d %s", code, data)
			}
			comp, grade := s.callbacks(t, id)
			if comp.Status != "success" {
				t.Fatalf("completion %s\nserver output:\n%s", comp.Raw, s.srv.Output())
			}
			sample, ok := grade.Samples["exec"]
			if !ok || grade.Status != "success" {
				t.Fatalf("grader callback %s", grade.Raw)
			}
			if sample.Reward == nil || *sample.Reward != 1 {
				t.Errorf("reward %v, want 1 (the agent answers 42)", sample.Reward)
			}
			a.shape(t, sample.Messages)
			if len(sample.LLMCalls) < 2 {
				t.Errorf("%d llm_calls recorded, want the tool turn and the answer", len(sample.LLMCalls))
			}
			for i, c := range sample.LLMCalls {
				if a.stream != c.Stream {
					t.Errorf("llm_calls[%d]: stream %v", i, c.Stream)
				}
				if c.API != a.api || c.Model != osmo.PlaceholderModel || c.StatusCode != 200 {
					t.Errorf("llm_calls[%d]: api %v model %v status %v, want %s calls routed as %s", i, c.API, c.Model, c.StatusCode, a.api, osmo.PlaceholderModel)
				}
			}
			for _, c := range s.ctl.Chats() {
				if c.Header.Get("X-Rollout-Id") != id || c.Header.Get("X-Sample-Id") != "exec" || c.Header.Get("Authorization") != "Bearer "+controllerKey {
					t.Errorf("LLM call headers: %v", c.Header)
				}
			}
			s.onlyOnce(t, id)
		})
	}
}

// TestG2ExecAgentRelativeToDir runs a JavaScript agent as a user writes
// it, node and a script with paths relative to the config's dir: the
// program works in a scratch directory of its own, and Node still finds the
// agent's node_modules from the script's location.
func TestG2ExecAgentRelativeToDir(t *testing.T) {
	tsx("openai-agents.ts")(t) // fails, naming npm ci, without node_modules
	cfg := filepath.Join(t.TempDir(), "agent.json")
	doc := `{"command": ["node", "node_modules/.bin/tsx", "openai-agents.ts"], "dir": "../examples/agents-js"}`
	if err := os.WriteFile(cfg, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	s := startG2(t, nil, nil, "--workflow", "exec", "--workflow-config", cfg, "--grader", "multiply")
	const id = "exec-relative"
	if code, data := s.startRollout(t, id, "What is 6 times 7?", "42", nil); code != 202 {
		t.Fatalf("POST /rollout = %d %s", code, data)
	}
	comp, grade := s.callbacks(t, id)
	if comp.Status != "success" {
		t.Fatalf("completion %s\nserver output:\n%s", comp.Raw, s.srv.Output())
	}
	if sample, ok := grade.Samples["exec"]; !ok || sample.Reward == nil || *sample.Reward != 1 {
		t.Errorf("grader callback %s, want the exec sample rewarded 1", grade.Raw)
	}
	s.onlyOnce(t, id)
}

// TestG2CancelLeavesNothingRunning cancels an exec rollout whose agent
// started a grandchild and waits on an LLM call the policy never answers:
// both processes must be gone, the upstream call aborted, and the
// completion posted once as cancelled.
func TestG2CancelLeavesNothingRunning(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is needed for the hanging agent: %v", err)
	}
	script, err := filepath.Abs("testdata/hang_agent.py")
	if err != nil {
		t.Fatal(err)
	}
	pidDir := t.TempDir()
	s := startG2(t, []string{"--fail-mode", "hang", "--fail-every", "1"}, []string{"E2E_PID_DIR=" + pidDir},
		append([]string{"--exec", py + " " + script}, passEnv(t, "E2E_PID_DIR")...)...)

	const id = "cancel-me"
	if code, data := s.startRollout(t, id, "What is 6 times 7?", "42", nil); code != 202 {
		t.Fatalf("POST /rollout = %d %s", code, data)
	}
	pids := waitPIDs(t, filepath.Join(pidDir, id))
	waitFor(t, "the agent's LLM call to reach the controller", func() bool { return s.ctl.InFlight() == 1 })

	code, _, resp := do(t, "POST", s.base+"/rollout/cancel", "Bearer "+serverKey, `{"ids":["`+id+`","nope"]}`)
	d, _ := resp["dispositions"].(map[string]any)
	if code != 200 || d[id] != "cancelled_running" || d["nope"] != "not_found" {
		t.Fatalf("cancel = %d %v", code, resp)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	comp, err := s.ctl.WaitCompletion(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if comp.Status != "cancelled" {
		t.Errorf("completion %s, want status cancelled", comp.Raw)
	}
	for _, pid := range pids {
		waitFor(t, fmt.Sprintf("process %d to be gone", pid), func() bool {
			return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
		})
	}
	waitFor(t, "the upstream LLM call to be aborted", func() bool { return s.ctl.InFlight() == 0 })
	s.onlyOnce(t, id)
	code, _, st := do(t, "GET", s.base+"/rollout/"+id+"/status", "Bearer "+serverKey, "")
	if code != 200 || st["status"] != "cancelled" {
		t.Errorf("status %d %v", code, st)
	}
}

func waitPIDs(t *testing.T, path string) []int {
	t.Helper()
	var data []byte
	waitFor(t, "the agent to record its pids", func() bool {
		var err error
		data, err = os.ReadFile(path)
		return err == nil
	})
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("pid file %q: %v", data, err)
		}
		pids = append(pids, pid)
	}
	return pids
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func hasItemType(typ string) func(t *testing.T, msgs []map[string]any) {
	return func(t *testing.T, msgs []map[string]any) {
		t.Helper()
		for _, m := range msgs {
			if m["type"] == typ {
				return
			}
		}
		t.Errorf("no %q item among the session items %v", typ, msgs)
	}
}

func hasBlock(key string) func(t *testing.T, msgs []map[string]any) {
	return func(t *testing.T, msgs []map[string]any) {
		t.Helper()
		for _, m := range msgs {
			blocks, _ := m["content"].([]any)
			for _, b := range blocks {
				if bm, ok := b.(map[string]any); ok && bm[key] != nil {
					return
				}
			}
		}
		t.Errorf("no %q block among the messages %v", key, msgs)
	}
}

func hasRole(role string) func(t *testing.T, msgs []map[string]any) {
	return func(t *testing.T, msgs []map[string]any) {
		t.Helper()
		for _, m := range msgs {
			if m["role"] == role {
				return
			}
		}
		t.Errorf("no %q message among %v", role, msgs)
	}
}

// tsx runs a TypeScript agent of examples/agents-js with its pinned tsx.
func tsx(script string, args ...string) func(t *testing.T) []string {
	return func(t *testing.T) []string {
		t.Helper()
		dir, err := filepath.Abs("../examples/agents-js")
		if err != nil {
			t.Fatal(err)
		}
		bin := filepath.Join(dir, "node_modules", ".bin", "tsx")
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("%s is missing: run `npm ci` in examples/agents-js", bin)
		}
		return append([]string{bin, filepath.Join(dir, script)}, args...)
	}
}

func python(script string) func(t *testing.T) []string {
	return func(t *testing.T) []string {
		t.Helper()
		py, err := exec.LookPath("python3")
		if err != nil {
			t.Fatalf("python3 is not on PATH: %v", err)
		}
		abs, err := filepath.Abs("../examples/" + script)
		if err != nil {
			t.Fatal(err)
		}
		return []string{py, abs}
	}
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
