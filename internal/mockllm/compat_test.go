package mockllm_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

// Request bodies as the agent frameworks send them over Chat Completions
// (captured from @openai/agents 0.20 and @strands-agents/sdk 1.19), so the
// mock keeps understanding their quirks: strict tool schemas with $schema
// and integer bounds, assistant turns with null or empty content next to
// tool_calls, user content as a list of parts, max_completion_tokens, and
// streaming with stream_options.
const (
	agentsTools = `[{"type":"function","function":{"name":"multiply","description":"Multiply two integers.",
		"parameters":{"$schema":"http://json-schema.org/draft-07/schema#","type":"object",
		"properties":{"a":{"type":"integer","minimum":-9007199254740991,"maximum":9007199254740991},
		"b":{"type":"integer","minimum":-9007199254740991,"maximum":9007199254740991}},
		"required":["a","b"],"additionalProperties":false},"strict":true}}]`
	agentsFirst = `{"model":"openai/osmosis-rollout","messages":[
		{"content":"Use the multiply tool when arithmetic is required.","role":"system"},
		{"role":"user","content":"What is 6 times 7?"}],
		"tools":` + agentsTools + `,"temperature":1,"max_tokens":4096,"stream":false,
		"parallel_tool_calls":false,"store":false,"user":"sample-0"}`
	agentsSecond = `{"model":"openai/osmosis-rollout","messages":[
		{"content":"Use the multiply tool when arithmetic is required.","role":"system"},
		{"role":"user","content":"What is 6 times 7?"},
		{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]},
		{"role":"tool","tool_call_id":"call_1","content":"42"}],
		"tools":` + agentsTools + `,"temperature":1,"max_tokens":4096,"stream":false}`

	strandsTools = `[{"type":"function","function":{"name":"calculator","description":"Evaluate a math expression.",
		"parameters":{"type":"object","properties":{"expression":{"type":"string","description":"An arithmetic expression."}},
		"required":["expression"],"additionalProperties":false}}}]`
	strandsFirst = `{"model":"openai/osmosis-rollout","messages":[
		{"role":"system","content":"You are a math assistant. Use the calculator tool."},
		{"role":"user","content":[{"type":"text","text":"What is 6 times 7?"}]}],
		"stream":true,"stream_options":{"include_usage":true},"temperature":1,"max_completion_tokens":4096,
		"tools":` + strandsTools + `}`
	strandsSecond = `{"model":"openai/osmosis-rollout","messages":[
		{"role":"system","content":"You are a math assistant. Use the calculator tool."},
		{"role":"user","content":[{"type":"text","text":"What is 6 times 7?"}]},
		{"role":"assistant","content":"","tool_calls":[{"id":"call_2","type":"function","function":{"name":"calculator","arguments":"{\"expression\":\"6 * 7\"}"}}]},
		{"role":"tool","tool_call_id":"call_2","content":"42"}],
		"stream":true,"stream_options":{"include_usage":true},"temperature":1,"max_completion_tokens":4096,
		"tools":` + strandsTools + `}`
)

func TestFrameworkRequests(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	final := "The answer is 42.\n#### 42"
	for _, tc := range []struct {
		name               string
		body               string
		toolName, toolArgs string // the expected call, or "" for a text answer
		content            string
	}{
		{"openai agents tool turn", agentsFirst, "multiply", `{"a":6,"b":7}`, ""},
		{"openai agents final turn", agentsSecond, "", "", final},
		{"strands tool turn", strandsFirst, "calculator", `{"expression":"6 * 7"}`, ""},
		{"strands final turn", strandsSecond, "", "", final},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := do(t, http.MethodPost, base+"/v1/chat/completions", tc.body, nil)
			if rep.status != http.StatusOK {
				t.Fatalf("status %d: %s", rep.status, rep.body)
			}
			var name, args, content string
			if strings.Contains(tc.body, `"stream":true`) {
				got := reassemble(t, sseEvents(t, rep.body))
				if got.usage == nil {
					t.Error("stream_options.include_usage was asked but no usage chunk came")
				}
				name, args, content = got.toolName, got.toolArgs, got.content
			} else {
				var out map[string]any
				if err := json.Unmarshal(rep.body, &out); err != nil {
					t.Fatalf("decoding %s: %v", rep.body, err)
				}
				msg := firstChoice(t, out)["message"].(map[string]any)
				if tcs, ok := msg["tool_calls"].([]any); ok {
					fn := tcs[0].(map[string]any)["function"].(map[string]any)
					name, args = fn["name"].(string), fn["arguments"].(string)
				}
				content, _ = msg["content"].(string)
			}
			if name != tc.toolName || args != tc.toolArgs || content != tc.content {
				t.Fatalf("got call %q %s content %q, want call %q %s content %q", name, args, content, tc.toolName, tc.toolArgs, tc.content)
			}
		})
	}
}

func TestToolChoice(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	user := map[string]any{"role": "user", "content": "What is 6 * 7 + 3?"}
	for _, tc := range []struct {
		name   string
		choice any
		call   string // the first tool called, or "" for a text answer
		final  string
	}{
		{"absent", nil, "multiply", "45"},
		{"auto", "auto", "multiply", "45"},
		{"required", "required", "multiply", "45"},
		{"none answers inline", "none", "", "45"},
		{"named narrows the tools", map[string]any{"type": "function", "function": map[string]any{"name": "add"}}, "add", "45"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := map[string]any{"messages": []any{user}, "tools": tools("add", "multiply")}
			if tc.choice != nil {
				req["tool_choice"] = tc.choice
			}
			msg := firstChoice(t, chat(t, base, req))["message"].(map[string]any)
			tcs, _ := msg["tool_calls"].([]any)
			switch {
			case tc.call == "":
				if content, _ := msg["content"].(string); len(tcs) != 0 || !strings.HasSuffix(content, "#### "+tc.final) {
					t.Fatalf("tool_calls %v content %q, want a text answer %s", tcs, content, tc.final)
				}
			case len(tcs) != 1:
				t.Fatalf("tool_calls %v, want one call to %s", tcs, tc.call)
			default:
				fn := tcs[0].(map[string]any)["function"].(map[string]any)
				if fn["name"] != tc.call {
					t.Fatalf("called %v, want %s", fn["name"], tc.call)
				}
			}
		})
	}
	t.Run("named tool does the part it can, the rest inline", func(t *testing.T) {
		named := map[string]any{"type": "function", "function": map[string]any{"name": "add"}}
		msgs := []any{user,
			map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": "c1", "type": "function", "function": map[string]any{"name": "add", "arguments": `{"a":42,"b":3}`}}}},
			map[string]any{"role": "tool", "tool_call_id": "c1", "content": "45"},
		}
		msg := firstChoice(t, chat(t, base, map[string]any{"messages": msgs, "tools": tools("add", "multiply"), "tool_choice": named}))["message"].(map[string]any)
		if content, _ := msg["content"].(string); content != "The answer is 45.\n#### 45" {
			t.Fatalf("message %v, want the final answer", msg)
		}
	})
	t.Run("a choice that changes the answer changes the id", func(t *testing.T) {
		auto := chat(t, base, map[string]any{"messages": []any{user}, "tools": tools("add", "multiply")})
		none := chat(t, base, map[string]any{"messages": []any{user}, "tools": tools("add", "multiply"), "tool_choice": "none"})
		if auto["id"] == none["id"] {
			t.Fatalf("both answers have id %v", auto["id"])
		}
	})
	for _, bad := range []struct {
		name   string
		choice any
	}{
		{"unknown mode", "sometimes"},
		{"not a string or object", 7},
		{"object without a name", map[string]any{"type": "function"}},
		{"unknown tool", map[string]any{"type": "function", "function": map[string]any{"name": "divide"}}},
	} {
		t.Run("rejects "+bad.name, func(t *testing.T) {
			rep := do(t, http.MethodPost, base+"/v1/chat/completions",
				map[string]any{"messages": []any{user}, "tools": tools("add", "multiply"), "tool_choice": bad.choice}, nil)
			if rep.status != http.StatusBadRequest {
				t.Fatalf("status %d, want 400: %s", rep.status, rep.body)
			}
			if e := errorBody(t, rep); e.Param == nil || *e.Param != "tool_choice" || !strings.Contains(e.Message, "tool_choice") {
				t.Fatalf("error %+v, want param tool_choice named in the message", e)
			}
		})
	}
}
