//go:build unix

package examples_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

const (
	// runTimeout bounds one agent process. A TypeScript agent takes a few
	// seconds to start (tsx compiles it, the SDKs load); a failing one also
	// waits out its client's retries.
	runTimeout = 90 * time.Second
	// upstreamModel is what the proxy sends instead of the placeholder.
	upstreamModel = "mock-policy"
	// maxOutput caps what is kept of an agent's stdout or stderr.
	maxOutput = 8 << 20
	sampleID  = "sample-0"
	task      = "What is 6 times 7?"
)

// agent is one exec-workflow program under test.
type agent struct {
	name string
	// command returns the program and its arguments, failing the test when
	// a prerequisite is missing.
	command func(t *testing.T) []string
	// stream says whether the framework streams its chat completions.
	stream bool
	// checkShape asserts the framework-native shape of the final messages.
	checkShape func(t *testing.T, msgs []map[string]any)
}

var agents = []agent{
	{name: "openai-agents", command: tsx("openai-agents.ts"), checkShape: checkAgentsItems},
	{name: "strands", command: tsx("strands.ts"), stream: true, checkShape: checkStrandsMessages},
	{name: "python-stdlib", command: python("python-stdlib/agent.py"), checkShape: checkChatMessages},
}

// TestAgentsSolveThroughTheProxy runs each agent exactly as the exec runner
// will and checks its messages, the proxy's record and the token.
func TestAgentsSolveThroughTheProxy(t *testing.T) {
	for _, a := range agents {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			argv := a.command(t)
			s := newStack(t, mockllm.Options{})
			rollout := "rollout-" + a.name
			token := s.bind(rollout)

			res := runAgent(t, argv, s.env(rollout, token), sampleInput(task))
			if res.exit != 0 {
				t.Fatalf("exit %d (%v), want 0\nstderr:\n%s", res.exit, res.err, res.stderr)
			}
			msgs := lastLineMessages(t, res.stdout)
			a.checkShape(t, msgs)
			if text := finalText(msgs); !strings.Contains(text, "42") {
				t.Errorf("final assistant text %q does not contain 42", text)
			}

			calls := s.store.Calls(rollout)
			if len(calls) < 2 {
				t.Fatalf("proxy recorded %d calls for %s, want a tool turn and a final turn", len(calls), rollout)
			}
			for i, c := range calls {
				if c.SampleID != sampleID || c.RequestedModel != osmo.PlaceholderModel || c.Model != upstreamModel ||
					c.StatusCode != 200 || c.Error != "" || c.Stream != a.stream {
					t.Errorf("call %d: sample %q requested %q sent %q status %d err %q stream %v; want sample %q, %q rewritten to %q, 200, stream %v",
						i, c.SampleID, c.RequestedModel, c.Model, c.StatusCode, c.Error, c.Stream, sampleID, osmo.PlaceholderModel, upstreamModel, a.stream)
				}
			}
			if last := calls[len(calls)-1]; !bytes.Contains(last.ResponseMessage, []byte(`#### 42`)) {
				t.Errorf("last recorded response %s, want the final answer", last.ResponseMessage)
			}
		})
	}
}

// TestAgentsFail checks that every failure ends the process non-zero with a
// message on stderr that names it.
func TestAgentsFail(t *testing.T) {
	for _, a := range agents {
		for _, tc := range []struct {
			name string
			mock mockllm.Options
			// token overrides the rollout's token when set.
			token string
			stdin []byte
			// stderr must contain this.
			stderr string
			// upstream is how many requests the mock may receive (-1: any).
			upstream int64
		}{
			{name: "wrong token", token: "not-the-rollout-token", stdin: sampleInput(task), stderr: "401", upstream: 0},
			// The proxy answers a failed upstream with 502 and says why.
			{name: "upstream fails", mock: mockllm.Options{FailMode: mockllm.Fail500, FailEvery: 1}, stdin: sampleInput(task), stderr: "upstream answered 500", upstream: -1},
			{name: "bad stdin", stdin: []byte(`{"prompt": "not a list"}`), stderr: "prompt", upstream: 0},
		} {
			t.Run(a.name+"/"+tc.name, func(t *testing.T) {
				t.Parallel()
				argv := a.command(t)
				s := newStack(t, tc.mock)
				rollout := "rollout-" + a.name
				token := s.bind(rollout)
				if tc.token != "" {
					token = tc.token
				}

				res := runAgent(t, argv, s.env(rollout, token), tc.stdin)
				// A clean non-zero status, not a death by signal.
				if res.exit <= 0 {
					t.Fatalf("exit %d (%v), want a non-zero exit status\nstdout:\n%s\nstderr:\n%s", res.exit, res.err, res.stdout, res.stderr)
				}
				t.Logf("stderr: %s", res.stderr)
				if !strings.Contains(res.stderr, tc.stderr) {
					t.Errorf("stderr does not name the failure (%q):\n%s", tc.stderr, res.stderr)
				}
				if n := s.mock.Requests(); tc.upstream >= 0 && n != tc.upstream {
					t.Errorf("upstream got %d requests, want %d", n, tc.upstream)
				}
				if tc.mock.FailMode != "" {
					calls := s.store.Calls(rollout)
					if len(calls) == 0 {
						t.Fatal("proxy recorded no call")
					}
					if c := calls[0]; c.StatusCode != http.StatusBadGateway || !strings.Contains(c.Error, "500") || c.SampleID != sampleID {
						t.Errorf("proxy recorded status %d err %q sample %q, want 502 naming the upstream's 500 for %s", c.StatusCode, c.Error, c.SampleID, sampleID)
					}
				}
			})
		}
	}
}

// stack is the mock policy behind a real LLM proxy, both on loopback.
type stack struct {
	mock     *mockllm.Server
	mockURL  string
	proxyURL string
	routes   *llmproxy.RouteTable
	store    *llmproxy.Store
}

func newStack(t *testing.T, opts mockllm.Options) *stack {
	t.Helper()
	mock, err := mockllm.New(opts)
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	mockSrv := httptest.NewServer(mock)
	t.Cleanup(mockSrv.Close)

	s := &stack{mock: mock, mockURL: mockSrv.URL, routes: llmproxy.NewRouteTable(), store: llmproxy.NewStore(0, 0)}
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:          s.routes,
		Recorder:        s.store,
		Timeout:         30 * time.Second,
		RequireSampleID: true,
	})
	if err != nil {
		t.Fatalf("llmproxy.New: %v", err)
	}
	proxySrv := httptest.NewServer(proxy)
	t.Cleanup(proxySrv.Close)
	s.proxyURL = proxySrv.URL
	return s
}

// bind routes rollout to the mock and returns the token its agent must present.
func (s *stack) bind(rollout string) string {
	token := "tok-" + rollout
	s.routes.Set(rollout, llmproxy.Route{BaseURL: s.mockURL + "/v1", Model: upstreamModel, ClientToken: token})
	return token
}

// env is the agent's whole environment: the contract's variables, plus
// what a program needs to start. Nothing else leaks in from the test's
// environment (no real OpenAI key, no HTTP proxy settings).
func (s *stack) env(rollout, token string) []string {
	base := llmproxy.BaseURLFor(s.proxyURL, rollout, sampleID)
	env := []string{
		"OPENAI_BASE_URL=" + base,
		"OSMOSIS_CHAT_COMPLETIONS_URL=" + base,
		"OPENAI_API_KEY=" + token,
		"OSMOSIS_ROLLOUT_ID=" + rollout,
		"OSMOSIS_SAMPLE_ID=" + sampleID,
	}
	for _, k := range []string{"PATH", "HOME", "TMPDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}

func sampleInput(prompt string) []byte {
	b, _ := json.Marshal(map[string]any{
		"prompt": []any{map[string]any{"role": "user", "content": prompt}},
		// null, as an older runner or another caller may send it: the
		// agents read it as no metadata.
		"metadata": nil,
		"config":   map[string]any{"temperature": 1.0},
	})
	return b
}

// tsx runs a TypeScript agent of agents-js with its pinned tsx.
func tsx(script string) func(t *testing.T) []string {
	return func(t *testing.T) []string {
		t.Helper()
		dir, err := filepath.Abs("agents-js")
		if err != nil {
			t.Fatal(err)
		}
		bin := filepath.Join(dir, "node_modules", ".bin", "tsx")
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("%s is missing: run `npm ci` in examples/agents-js to install the agents' dependencies", bin)
		}
		if _, err := exec.LookPath("node"); err != nil {
			t.Fatalf("node is not on PATH; the JavaScript agents need Node.js 20 or later: %v", err)
		}
		return []string{bin, filepath.Join(dir, script)}
	}
}

func python(script string) func(t *testing.T) []string {
	return func(t *testing.T) []string {
		t.Helper()
		py, err := exec.LookPath("python3")
		if err != nil {
			t.Fatalf("python3 is not on PATH; the Python agent needs Python 3.11 or later: %v", err)
		}
		abs, err := filepath.Abs(script)
		if err != nil {
			t.Fatal(err)
		}
		return []string{py, abs}
	}
}

type result struct {
	exit           int
	err            error
	stdout, stderr string
}

// runAgent runs argv in its own process group with env and stdin, as the
// exec runner does, and kills the whole group when it is done: a launcher
// such as tsx runs the agent in a child process.
func runAgent(t *testing.T, argv, env []string, stdin []byte) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), runTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = filepath.Dir(argv[len(argv)-1])
	cmd.Env = env
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr cappedBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second

	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %v: %v", argv, err)
	}
	err := cmd.Wait()
	// Reap whatever the agent left behind in its group.
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	if ctx.Err() != nil {
		t.Fatalf("%v did not finish within %v\nstderr:\n%s", argv, runTimeout, stderr.String())
	}
	res := result{exit: cmd.ProcessState.ExitCode(), stdout: stdout.String(), stderr: stderr.String()}
	var exitErr *exec.ExitError
	if err != nil && !errors.As(err, &exitErr) {
		res.err = err
	}
	return res
}

// cappedBuffer keeps the first maxOutput bytes written to it.
type cappedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *cappedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if room := maxOutput - b.buf.Len(); room > 0 {
		b.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (b *cappedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// lastLineMessages decodes the last stdout line as {"messages": [...]}, as
// the runner does.
func lastLineMessages(t *testing.T, stdout string) []map[string]any {
	t.Helper()
	out := strings.TrimRight(stdout, "\r\n")
	line := out[strings.LastIndexByte(out, '\n')+1:]
	var doc struct {
		Messages []map[string]any `json:"messages"`
	}
	if err := json.Unmarshal([]byte(line), &doc); err != nil || doc.Messages == nil {
		t.Fatalf("last stdout line is not {\"messages\": [...]} (%v):\n%s", err, line)
	}
	return doc.Messages
}

// finalText is the last assistant text, the way the graders read it: a
// string content, or the first text of a list of content blocks.
func finalText(msgs []map[string]any) string {
	for i := len(msgs) - 1; i >= 0; i-- {
		if msgs[i]["role"] != "assistant" {
			continue
		}
		switch c := msgs[i]["content"].(type) {
		case string:
			return c
		case []any:
			for _, b := range c {
				if bm, _ := b.(map[string]any); bm != nil {
					if s, _ := bm["text"].(string); s != "" {
						return s
					}
				}
			}
		}
	}
	return ""
}

// checkAgentsItems: the Agents SDK's session items, in its own protocol
// shape: a function_call with camelCase callId and its function_call_result.
func checkAgentsItems(t *testing.T, items []map[string]any) {
	t.Helper()
	var callID string
	for _, it := range items {
		if it["type"] == "function_call" && it["name"] == "multiply" {
			callID, _ = it["callId"].(string)
			var args struct{ A, B int }
			if s, _ := it["arguments"].(string); json.Unmarshal([]byte(s), &args) != nil || args.A*args.B != 42 {
				t.Errorf("multiply arguments %v, want two integers whose product is 42", it["arguments"])
			}
		}
	}
	if callID == "" {
		t.Fatalf("no function_call item named multiply with a callId in %v", items)
	}
	for _, it := range items {
		if it["type"] == "function_call_result" && it["callId"] == callID {
			out, _ := it["output"].(map[string]any)
			if out["text"] != "42" {
				t.Errorf("function_call_result output %v, want text 42", it["output"])
			}
			if last := items[len(items)-1]; last["role"] != "assistant" || last["type"] != "message" {
				t.Errorf("last item %v, want the assistant message", last)
			}
			return
		}
	}
	t.Fatalf("no function_call_result for call %s in %v", callID, items)
}

// checkStrandsMessages: Strands messages, user and assistant turns of
// content blocks, the tool call a toolUse and its result a toolResult.
func checkStrandsMessages(t *testing.T, msgs []map[string]any) {
	t.Helper()
	var useID string
	for _, b := range blocks(msgs, "assistant", "toolUse") {
		if b["name"] == "calculator" {
			useID, _ = b["toolUseId"].(string)
			if in, _ := b["input"].(map[string]any); in["expression"] != "6 * 7" {
				t.Errorf("calculator input %v, want expression 6 * 7", b["input"])
			}
		}
	}
	if useID == "" {
		t.Fatalf("no toolUse block named calculator in %v", msgs)
	}
	for _, b := range blocks(msgs, "user", "toolResult") {
		if b["toolUseId"] == useID {
			content, _ := b["content"].([]any)
			if b["status"] != "success" || len(content) != 1 || content[0].(map[string]any)["text"] != "42" {
				t.Errorf("toolResult %v, want status success and text 42", b)
			}
			return
		}
	}
	t.Fatalf("no toolResult block for toolUse %s in %v", useID, msgs)
}

// blocks returns the kind content blocks of the role's messages.
func blocks(msgs []map[string]any, role, kind string) []map[string]any {
	var out []map[string]any
	for _, m := range msgs {
		if m["role"] != role {
			continue
		}
		content, _ := m["content"].([]any)
		for _, b := range content {
			bm, _ := b.(map[string]any)
			if inner, ok := bm[kind].(map[string]any); ok {
				out = append(out, inner)
			}
		}
	}
	return out
}

// checkChatMessages: plain OpenAI chat messages, an assistant turn with
// tool_calls and a tool message answering it.
func checkChatMessages(t *testing.T, msgs []map[string]any) {
	t.Helper()
	var callID string
	for _, m := range msgs {
		calls, _ := m["tool_calls"].([]any)
		for _, c := range calls {
			cm, _ := c.(map[string]any)
			if fn, _ := cm["function"].(map[string]any); m["role"] == "assistant" && fn["name"] == "multiply" {
				callID, _ = cm["id"].(string)
			}
		}
	}
	if callID == "" {
		t.Fatalf("no assistant tool call to multiply in %v", msgs)
	}
	for _, m := range msgs {
		if m["role"] == "tool" && m["tool_call_id"] == callID {
			if m["content"] != "42" {
				t.Errorf("tool message %v, want content 42", m)
			}
			return
		}
	}
	t.Fatalf("no tool message for call %s in %v", callID, msgs)
}
