package mockllm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

const testTimeout = 10 * time.Second

// start serves a mock with opts on loopback for the test's lifetime.
func start(t *testing.T, opts mockllm.Options) (*mockllm.Server, string) {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s, err := mockllm.New(opts)
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	return s, ts.URL
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request; body may be a []byte, a string or a value to encode.
func do(t *testing.T, method, url string, body any, header map[string]string) reply {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		r = bytes.NewReader(b)
	case string:
		r = strings.NewReader(b)
	default:
		enc, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		r = bytes.NewReader(enc)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, url, err)
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: b}
}

// chat posts a chat request and decodes a 200 JSON answer.
func chat(t *testing.T, base string, req map[string]any) map[string]any {
	t.Helper()
	rep := do(t, http.MethodPost, base+"/v1/chat/completions", req, nil)
	if rep.status != http.StatusOK {
		t.Fatalf("status %d: %s", rep.status, rep.body)
	}
	var out map[string]any
	if err := json.Unmarshal(rep.body, &out); err != nil {
		t.Fatalf("decoding %s: %v", rep.body, err)
	}
	return out
}

func firstChoice(t *testing.T, resp map[string]any) map[string]any {
	t.Helper()
	choices, _ := resp["choices"].([]any)
	if len(choices) != 1 {
		t.Fatalf("want 1 choice, got %v", resp["choices"])
	}
	return choices[0].(map[string]any)
}

func binaryTool(name string) map[string]any {
	return map[string]any{"type": "function", "function": map[string]any{
		"name": name, "description": name + " two numbers",
		"parameters": map[string]any{"type": "object", "required": []any{"a", "b"}, "properties": map[string]any{
			"a": map[string]any{"type": "number"}, "b": map[string]any{"type": "number"},
		}},
	}}
}

func calculatorTool(name string) map[string]any {
	return map[string]any{"type": "function", "function": map[string]any{
		"name": name,
		"parameters": map[string]any{"type": "object", "properties": map[string]any{
			"expression": map[string]any{"type": "string"},
		}},
	}}
}

func tools(names ...string) []any {
	out := make([]any, len(names))
	for i, n := range names {
		out[i] = binaryTool(n)
	}
	return out
}

// call is one tool call as the agent saw it.
type call struct{ name, args string }

// executor answers a tool call with the tool message's content.
type executor func(t *testing.T, c call) string

// arithmetic runs add/subtract/multiply/divide like the calculator workflow.
func arithmetic(t *testing.T, c call) string {
	t.Helper()
	var args struct{ A, B *float64 }
	if err := json.Unmarshal([]byte(c.args), &args); err != nil || args.A == nil || args.B == nil {
		t.Fatalf("tool %s: bad arguments %q", c.name, c.args)
	}
	a, b := *args.A, *args.B
	var v float64
	switch c.name {
	case "add":
		v = a + b
	case "subtract":
		v = a - b
	case "multiply":
		v = a * b
	case "divide":
		v = a / b
	default:
		t.Fatalf("unexpected tool %q", c.name)
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

// agentLoop plays the agent against the mock: it appends each assistant
// message, runs the tool it asks for, and stops at a final answer.
func agentLoop(t *testing.T, base, prompt string, toolDefs []any, exec executor) (final string, calls []call) {
	t.Helper()
	msgs := []any{
		map[string]any{"role": "system", "content": "You are a calculator."},
		map[string]any{"role": "user", "content": prompt},
	}
	for turn := 0; turn < 10; turn++ {
		req := map[string]any{"model": "openai/osmosis-rollout", "messages": msgs}
		if toolDefs != nil {
			req["tools"] = toolDefs
		}
		ch := firstChoice(t, chat(t, base, req))
		msg := ch["message"].(map[string]any)
		msgs = append(msgs, msg)
		tcs, _ := msg["tool_calls"].([]any)
		if len(tcs) == 0 {
			if ch["finish_reason"] != "stop" {
				t.Fatalf("final answer finish_reason = %v, want stop", ch["finish_reason"])
			}
			content, _ := msg["content"].(string)
			return content, calls
		}
		if ch["finish_reason"] != "tool_calls" || len(tcs) != 1 {
			t.Fatalf("turn %d: finish_reason %v with %d tool calls, want tool_calls with 1", turn, ch["finish_reason"], len(tcs))
		}
		tc := tcs[0].(map[string]any)
		fn := tc["function"].(map[string]any)
		id, _ := tc["id"].(string)
		if !strings.HasPrefix(id, "call_") || tc["type"] != "function" {
			t.Fatalf("tool call id %q type %v", id, tc["type"])
		}
		c := call{name: fn["name"].(string), args: fn["arguments"].(string)}
		calls = append(calls, c)
		msgs = append(msgs, map[string]any{"role": "tool", "tool_call_id": id, "content": exec(t, c)})
	}
	t.Fatalf("no final answer after 10 turns; calls %v", calls)
	return "", nil
}

// sseEvents reads a stream body into its data payloads, checking framing.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	raw := string(body)
	if !strings.HasSuffix(raw, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", raw)
	}
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(raw, "\n\n"), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(data, "\n") {
			t.Fatalf("bad SSE event %q", ev)
		}
		out = append(out, data)
	}
	return out
}
