package mockllm_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

func TestDeterministic(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	req := func(prompt string) map[string]any {
		return map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": prompt}},
			"tools": tools("add", "multiply"), "logprobs": true, "top_logprobs": 2, "return_token_ids": true}
	}
	a := do(t, http.MethodPost, base+"/v1/chat/completions", req("What is 12 * 7 + 3?"), nil)
	b := do(t, http.MethodPost, base+"/v1/chat/completions", req("What is 12 * 7 + 3?"), nil)
	if a.status != http.StatusOK || !bytes.Equal(a.body, b.body) {
		t.Fatalf("same request, different answers:\n%s\n%s", a.body, b.body)
	}
	// A fresh server answers the same too: nothing depends on its state.
	_, other := start(t, mockllm.Options{})
	if c := do(t, http.MethodPost, other+"/v1/chat/completions", req("What is 12 * 7 + 3?"), nil); !bytes.Equal(a.body, c.body) {
		t.Fatalf("another server answered differently:\n%s\n%s", a.body, c.body)
	}
	var r1, r2 map[string]any
	_ = json.Unmarshal(a.body, &r1)
	_ = json.Unmarshal(do(t, http.MethodPost, base+"/v1/chat/completions", req("What is 12 * 7 + 4?"), nil).body, &r2)
	if id, _ := r1["id"].(string); !strings.HasPrefix(id, "chatcmpl-") || id == r2["id"] {
		t.Fatalf("ids %v and %v: want chatcmpl-<hash>, distinct per request", r1["id"], r2["id"])
	}
	if r1["model"] != "m" || r1["object"] != "chat.completion" || r1["system_fingerprint"] == nil || r1["created"] == nil {
		t.Fatalf("envelope: %v", r1)
	}
}

func TestToolPlanningAcrossTurns(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	for _, tc := range []struct {
		prompt string
		tools  []any
		calls  []call
		answer string
	}{
		{"What is 12 * 7 + 3?", tools("add", "multiply"),
			[]call{{"multiply", `{"a":12,"b":7}`}, {"add", `{"a":84,"b":3}`}}, "87"},
		{"Compute (3 + 4) * 5", tools("add", "multiply"),
			[]call{{"add", `{"a":3,"b":4}`}, {"multiply", `{"a":7,"b":5}`}}, "35"},
		{"What is 6 times 7?", tools("add", "multiply"), []call{{"multiply", `{"a":6,"b":7}`}}, "42"},
		{"What is 6 plus 7?", tools("add", "multiply"), []call{{"add", `{"a":6,"b":7}`}}, "13"},
		{"What is 2.5 multiplied by 4?", tools("add", "multiply"), []call{{"multiply", `{"a":2.5,"b":4}`}}, "10"},
		// Subtraction has no tool here, so it is done inline.
		{"What is 2 * (3 + 4) * 5 - 10?", tools("add", "multiply"),
			[]call{{"add", `{"a":3,"b":4}`}, {"multiply", `{"a":2,"b":7}`}, {"multiply", `{"a":14,"b":5}`}}, "60"},
		{"What is 2 * (3 + 4) * 5 - 10?", tools("add", "multiply", "subtract"),
			[]call{{"add", `{"a":3,"b":4}`}, {"multiply", `{"a":2,"b":7}`}, {"multiply", `{"a":14,"b":5}`}, {"subtract", `{"a":70,"b":10}`}}, "60"},
		{"What is 10 / 4 + 1?", tools("add", "divide"), []call{{"divide", `{"a":10,"b":4}`}, {"add", `{"a":2.5,"b":1}`}}, "3.5"},
		{"What is 3 * 4 + 5?", tools("multiply"), []call{{"multiply", `{"a":3,"b":4}`}}, "17"},
		{"What is 1 / 3?", tools("add", "multiply"), nil, "0.333333"},
		{"What is -2 * (1 + 1)?", tools("add", "multiply"), []call{{"add", `{"a":1,"b":1}`}, {"multiply", `{"a":-2,"b":2}`}}, "-4"},
	} {
		t.Run(tc.prompt, func(t *testing.T) {
			final, calls := agentLoop(t, base, tc.prompt, tc.tools, arithmetic)
			if !reflect.DeepEqual(calls, tc.calls) {
				t.Errorf("calls = %v, want %v", calls, tc.calls)
			}
			if want := "The answer is " + tc.answer + ".\n#### " + tc.answer; final != want {
				t.Errorf("final = %q, want %q", final, want)
			}
		})
	}
}

// The mock reads the results it is given rather than its own arithmetic,
// as a model does, and understands the other frameworks' result shapes.
func TestReadsToolResults(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	user := map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "What is 6 * 7 + 1?"}}}
	assistant := map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
		"id": "call_1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":6,"b":7}`}}}}
	for name, result := range map[string]any{
		"chat tool message":           map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "100"},
		"chat tool content parts":     map[string]any{"role": "tool", "tool_call_id": "call_1", "content": []any{map[string]any{"type": "text", "text": "100"}}},
		"agents function_call_output": map[string]any{"type": "function_call_output", "call_id": "call_1", "output": "100"},
		"strands toolResult":          map[string]any{"role": "user", "content": []any{map[string]any{"toolResult": map[string]any{"toolUseId": "call_1", "status": "success", "content": []any{map[string]any{"text": "100"}}}}}},
		"json result":                 map[string]any{"role": "tool", "tool_call_id": "call_1", "content": `{"result": 100}`},
	} {
		t.Run(name, func(t *testing.T) {
			ch := firstChoice(t, chat(t, base, map[string]any{"messages": []any{user, assistant, result}, "tools": tools("add", "multiply")}))
			tcs := ch["message"].(map[string]any)["tool_calls"].([]any)
			if args := tcs[0].(map[string]any)["function"].(map[string]any)["arguments"]; args != `{"a":100,"b":1}` {
				t.Fatalf("next call arguments = %v, want the tool's result 100 used", args)
			}
		})
	}
	t.Run("an error result is worked around inline", func(t *testing.T) {
		bad := map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "Error: boom"}
		ch := firstChoice(t, chat(t, base, map[string]any{"messages": []any{user, assistant, bad}, "tools": tools("add", "multiply")}))
		args := ch["message"].(map[string]any)["tool_calls"].([]any)[0].(map[string]any)["function"].(map[string]any)["arguments"]
		if args != `{"a":42,"b":1}` {
			t.Fatalf("arguments = %v", args)
		}
	})
}

func TestCalculatorTool(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	for _, name := range []string{"calculator", "evaluate"} {
		t.Run(name, func(t *testing.T) {
			exec := func(t *testing.T, c call) string {
				if c.name != name || c.args != `{"expression":"(3 + 4) * 5"}` {
					t.Fatalf("call %v", c)
				}
				return "35"
			}
			final, calls := agentLoop(t, base, "Compute (3 + 4) * 5, please.", []any{calculatorTool(name)}, exec)
			if len(calls) != 1 || final != "The answer is 35.\n#### 35" {
				t.Fatalf("calls %v final %q", calls, final)
			}
		})
	}
}

func TestNoToolsAndNoTask(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	for _, tc := range []struct{ prompt, want string }{
		{"What is 12 * 7 + 3?", "The answer is 87.\n#### 87"},
		{"What is (1 + 2) * (3 + 4) / 2?", "The answer is 10.5.\n#### 10.5"},
		{"What is 1 / 0?", "The expression is undefined (it divides by zero)."},
		{"Hello, how are you?", `I'm sorry, I can only help with arithmetic. Please ask something like "What is 12 * 7 + 3?".`},
	} {
		t.Run(tc.prompt, func(t *testing.T) {
			// Tools that cannot help (no arithmetic) change nothing.
			final, calls := agentLoop(t, base, tc.prompt, []any{map[string]any{"type": "function", "function": map[string]any{"name": "search"}}}, arithmetic)
			if len(calls) != 0 || final != tc.want {
				t.Fatalf("calls %v final %q, want %q", calls, final, tc.want)
			}
		})
	}
}

// streamed is a stream reassembled the way an OpenAI client does.
type streamed struct {
	id, content, finish           string
	toolID, toolName, toolArgs    string
	contentChunks, argChunks      int
	tokenIDs, promptIDs, logprobs []any
	usage                         any
}

func reassemble(t *testing.T, events []string) streamed {
	t.Helper()
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("last event %q, want [DONE]", events[len(events)-1])
	}
	var s streamed
	for i, data := range events[:len(events)-1] {
		var c map[string]any
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("event %d %q: %v", i, data, err)
		}
		if c["object"] != "chat.completion.chunk" || (s.id != "" && c["id"] != s.id) {
			t.Fatalf("event %d envelope %v", i, c)
		}
		s.id = c["id"].(string)
		if ids, ok := c["prompt_token_ids"].([]any); ok {
			if i != 0 {
				t.Fatalf("prompt_token_ids on chunk %d, want only the first", i)
			}
			s.promptIDs = ids
		}
		choices := c["choices"].([]any)
		if len(choices) == 0 {
			if s.finish == "" || c["usage"] == nil {
				t.Fatalf("chunk %d without choices must be the final usage chunk: %v", i, c)
			}
			s.usage = c["usage"]
			continue
		}
		if s.usage != nil {
			t.Fatalf("chunk after usage: %v", c)
		}
		ch := choices[0].(map[string]any)
		d := ch["delta"].(map[string]any)
		if i == 0 && d["role"] != "assistant" {
			t.Fatalf("first chunk delta %v, want the role", d)
		}
		if content, _ := d["content"].(string); content != "" {
			s.content += content
			s.contentChunks++
		}
		if tcs, ok := d["tool_calls"].([]any); ok {
			tc := tcs[0].(map[string]any)
			fn := tc["function"].(map[string]any)
			if id, ok := tc["id"].(string); ok {
				if s.toolID != "" || fn["arguments"] != "" || tc["type"] != "function" {
					t.Fatalf("tool call head %v: want one, with type and empty arguments", tc)
				}
				s.toolID, s.toolName = id, fn["name"].(string)
			} else {
				s.toolArgs += fn["arguments"].(string)
				s.argChunks++
			}
		}
		s.tokenIDs = append(s.tokenIDs, asSlice(ch["token_ids"])...)
		if lp, ok := ch["logprobs"].(map[string]any); ok {
			s.logprobs = append(s.logprobs, lp["content"].([]any)...)
		}
		if f, ok := ch["finish_reason"].(string); ok {
			if len(d) != 0 {
				t.Fatalf("finish chunk carries a delta %v", d)
			}
			s.finish = f
		}
	}
	return s
}

func asSlice(v any) []any { s, _ := v.([]any); return s }

func TestStreamReassemblesToTheJSONAnswer(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	user := map[string]any{"role": "user", "content": "What is 12 * 7 + 3?"}
	toolTurn := []any{user}
	finalTurn := []any{user,
		map[string]any{"role": "assistant", "tool_calls": []any{map[string]any{"id": "c1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":12,"b":7}`}}}},
		map[string]any{"role": "tool", "tool_call_id": "c1", "content": "84"},
		map[string]any{"role": "assistant", "tool_calls": []any{map[string]any{"id": "c2", "type": "function", "function": map[string]any{"name": "add", "arguments": `{"a":84,"b":3}`}}}},
		map[string]any{"role": "tool", "tool_call_id": "c2", "content": "87"},
	}
	for _, tc := range []struct {
		name     string
		messages []any
		extra    map[string]any
	}{
		{"tool call", toolTurn, nil},
		{"final answer", finalTurn, nil},
		{"tool call with ids and logprobs", toolTurn, map[string]any{"return_token_ids": true, "logprobs": true, "top_logprobs": 3}},
		{"final answer with ids and logprobs", finalTurn, map[string]any{"return_token_ids": true, "logprobs": true}},
		{"truncated", finalTurn, map[string]any{"max_tokens": 4, "return_token_ids": true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := map[string]any{"model": "m", "messages": tc.messages, "tools": tools("add", "multiply")}
			for k, v := range tc.extra {
				req[k] = v
			}
			want := chat(t, base, req)
			req["stream"] = true
			req["stream_options"] = map[string]any{"include_usage": true}
			rep := do(t, http.MethodPost, base+"/v1/chat/completions", req, nil)
			if rep.status != http.StatusOK || rep.header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("status %d content-type %q", rep.status, rep.header.Get("Content-Type"))
			}
			got := reassemble(t, sseEvents(t, rep.body))

			ch := firstChoice(t, want)
			msg := ch["message"].(map[string]any)
			if got.id != want["id"] || got.finish != ch["finish_reason"] {
				t.Errorf("id/finish %q/%q, want %v/%v", got.id, got.finish, want["id"], ch["finish_reason"])
			}
			if content, _ := msg["content"].(string); got.content != content {
				t.Errorf("content %q, want %q", got.content, content)
			}
			if tcs, ok := msg["tool_calls"].([]any); ok {
				fn := tcs[0].(map[string]any)["function"].(map[string]any)
				if got.toolID != tcs[0].(map[string]any)["id"] || got.toolName != fn["name"] || got.toolArgs != fn["arguments"] {
					t.Errorf("tool call %q %q %q, want %v", got.toolID, got.toolName, got.toolArgs, tcs[0])
				}
				if got.argChunks < 2 {
					t.Errorf("arguments came in %d chunks, want 2 or more", got.argChunks)
				}
			} else if got.toolID != "" || got.contentChunks < 2 {
				t.Errorf("text answer: tool call %q, %d content chunks", got.toolID, got.contentChunks)
			}
			if !reflect.DeepEqual(got.usage, want["usage"]) {
				t.Errorf("usage %v, want %v", got.usage, want["usage"])
			}
			if !reflect.DeepEqual(got.tokenIDs, asSlice(ch["token_ids"])) || !reflect.DeepEqual(got.promptIDs, asSlice(want["prompt_token_ids"])) {
				t.Errorf("token ids differ: stream %v / %v, json %v / %v", got.tokenIDs, got.promptIDs, ch["token_ids"], want["prompt_token_ids"])
			}
			var wantLP []any
			if lp, ok := ch["logprobs"].(map[string]any); ok {
				wantLP = lp["content"].([]any)
			}
			if !reflect.DeepEqual(got.logprobs, wantLP) {
				t.Errorf("logprobs differ: stream %v, json %v", got.logprobs, wantLP)
			}
		})
	}
	t.Run("no usage unless asked", func(t *testing.T) {
		rep := do(t, http.MethodPost, base+"/chat/completions", map[string]any{"messages": toolTurn, "stream": true}, nil)
		events := sseEvents(t, rep.body)
		got := reassemble(t, events)
		if got.usage != nil || got.finish != "stop" || !strings.Contains(got.content, "#### 87") {
			t.Fatalf("usage %v finish %q content %q", got.usage, got.finish, got.content)
		}
	})
}

func TestTokenIDsAndLogprobsOnlyWhenAsked(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	msgs := []any{
		map[string]any{"role": "system", "content": "You are a calculator."},
		map[string]any{"role": "user", "content": "What is 17 * 23 + 4?"},
	}
	for _, tc := range []struct {
		name          string
		extra         map[string]any
		ids, logprobs bool
		top           int
	}{
		{"plain", nil, false, false, 0},
		{"return_token_ids", map[string]any{"return_token_ids": true}, true, false, 0},
		{"extra_body", map[string]any{"extra_body": map[string]any{"return_token_ids": true}}, true, false, 0},
		{"logprobs", map[string]any{"logprobs": true}, false, true, 0},
		{"top_logprobs", map[string]any{"logprobs": true, "top_logprobs": 5, "return_token_ids": true}, true, true, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, withTools := range []bool{false, true} {
				req := map[string]any{"messages": msgs}
				if withTools {
					req["tools"] = tools("add", "multiply")
				}
				for k, v := range tc.extra {
					req[k] = v
				}
				resp := chat(t, base, req)
				ch := firstChoice(t, resp)
				u := resp["usage"].(map[string]any)
				prompt, completion := int(u["prompt_tokens"].(float64)), int(u["completion_tokens"].(float64))
				if int(u["total_tokens"].(float64)) != prompt+completion || prompt == 0 || completion == 0 {
					t.Fatalf("usage %v", u)
				}
				if d, _ := u["prompt_tokens_details"].(map[string]any); d == nil || d["cached_tokens"] != 0.0 {
					t.Fatalf("prompt_tokens_details %v", u["prompt_tokens_details"])
				}
				pids, tids := asSlice(resp["prompt_token_ids"]), asSlice(ch["token_ids"])
				if tc.ids != (pids != nil) || tc.ids != (tids != nil) {
					t.Fatalf("prompt_token_ids %v token_ids %v, asked: %v", pids, tids, tc.ids)
				}
				if tc.ids && (len(pids) != prompt || len(tids) != completion) {
					t.Fatalf("%d prompt ids for %d prompt tokens, %d ids for %d completion tokens", len(pids), prompt, len(tids), completion)
				}
				lp, _ := ch["logprobs"].(map[string]any)
				if tc.logprobs != (lp != nil) {
					t.Fatalf("logprobs %v, asked: %v", ch["logprobs"], tc.logprobs)
				}
				if lp == nil {
					continue
				}
				entries := lp["content"].([]any)
				if len(entries) != completion {
					t.Fatalf("%d logprob entries for %d tokens", len(entries), completion)
				}
				for _, e := range entries {
					e := e.(map[string]any)
					top := e["top_logprobs"].([]any)
					if e["logprob"].(float64) >= 0 || len(top) != tc.top || len(asSlice(e["bytes"])) != len(e["token"].(string)) {
						t.Fatalf("entry %v", e)
					}
					prev := 0.0
					for j, alt := range top {
						v := alt.(map[string]any)["logprob"].(float64)
						if (j == 0 && (alt.(map[string]any)["token"] != e["token"] || v != e["logprob"])) || (j > 0 && v >= prev) {
							t.Fatalf("top_logprobs not the sampled token first, then descending: %v", top)
						}
						prev = v
					}
				}
			}
		})
	}
}

func TestMaxTokensTruncates(t *testing.T) {
	_, base := start(t, mockllm.Options{})
	msgs := []any{map[string]any{"role": "user", "content": "What is 12 * 7 + 3?"}}
	full := firstChoice(t, chat(t, base, map[string]any{"messages": msgs}))["message"].(map[string]any)["content"].(string)
	for _, tc := range []struct {
		name  string
		extra map[string]any
		tools []any
	}{
		{"max_tokens on text", map[string]any{"max_tokens": 3}, nil},
		{"max_completion_tokens on text", map[string]any{"max_completion_tokens": 3, "max_tokens": 100}, nil},
		{"max_tokens on a tool call", map[string]any{"max_tokens": 3}, tools("add", "multiply")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := map[string]any{"messages": msgs}
			if tc.tools != nil {
				req["tools"] = tc.tools
			}
			for k, v := range tc.extra {
				req[k] = v
			}
			resp := chat(t, base, req)
			ch := firstChoice(t, resp)
			msg := ch["message"].(map[string]any)
			content, _ := msg["content"].(string)
			if ch["finish_reason"] != "length" || msg["tool_calls"] != nil || content == "" {
				t.Fatalf("choice %v, want finish length with partial text", ch)
			}
			if tc.tools == nil && !strings.HasPrefix(full, content) || content == full {
				t.Fatalf("content %q is not a strict prefix of %q", content, full)
			}
			if got := resp["usage"].(map[string]any)["completion_tokens"]; got != 3.0 {
				t.Fatalf("completion_tokens = %v, want 3", got)
			}
		})
	}
	t.Run("a roomy limit changes nothing", func(t *testing.T) {
		ch := firstChoice(t, chat(t, base, map[string]any{"messages": msgs, "max_tokens": 512}))
		if ch["finish_reason"] != "stop" || ch["message"].(map[string]any)["content"] != full {
			t.Fatalf("choice %v", ch)
		}
	})
}
