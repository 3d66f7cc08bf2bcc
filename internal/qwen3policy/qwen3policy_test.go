//go:build unix

package qwen3policy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/osmo-rl/osmo/internal/qwen3policy"
)

// requestTimeout bounds every HTTP exchange of a test.
const requestTimeout = 30 * time.Second

// multiplyTool is the schema of osmo's multiply workflow.
var multiplyTool = map[string]any{
	"type": "function",
	"function": map[string]any{
		"name":        "multiply",
		"description": "Multiply two integers.",
		"parameters": map[string]any{
			"type":                 "object",
			"properties":           map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
			"required":             []any{"a", "b"},
			"additionalProperties": false,
		},
	},
}

// reply is the part of a chat completion the tests read; pointers tell a
// missing or null field from an empty one.
type reply struct {
	PromptTokenIDs *[]int `json:"prompt_token_ids"`
	Choices        []struct {
		Message      map[string]json.RawMessage `json:"message"`
		TokenIDs     *[]int                     `json:"token_ids"`
		FinishReason string                     `json:"finish_reason"`
		Logprobs     *struct {
			Content []logprob `json:"content"`
		} `json:"logprobs"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

type logprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []byte  `json:"bytes"`
}

func (a logprob) equal(b logprob) bool {
	return a.Token == b.Token && a.Logprob == b.Logprob && bytes.Equal(a.Bytes, b.Bytes)
}

func (r *reply) promptIDs() []int {
	if r.PromptTokenIDs == nil {
		return nil
	}
	return *r.PromptTokenIDs
}

func (r *reply) tokenIDs() []int {
	if r.Choices[0].TokenIDs == nil {
		return nil
	}
	return *r.Choices[0].TokenIDs
}

func post(t *testing.T, p *qwen3policy.Policy, body map[string]any) (*http.Response, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
	defer cancel()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.URL()+"/chat/completions", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return resp, data
}

// chat sends body and decodes a 200 answer.
func chat(t *testing.T, p *qwen3policy.Policy, body map[string]any) (*reply, []byte) {
	t.Helper()
	resp, data := post(t, p, body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %s: %s", resp.Status, data)
	}
	var r reply
	if err := json.Unmarshal(data, &r); err != nil {
		t.Fatalf("decode %s: %v", data, err)
	}
	if len(r.Choices) != 1 {
		t.Fatalf("%d choices, want 1: %s", len(r.Choices), data)
	}
	return &r, data
}

func record(t *testing.T, p *qwen3policy.Policy) []qwen3policy.Call {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
	defer cancel()
	calls, err := p.Record(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return calls
}

// toolLoop runs the first call of a tool loop and the second, after the
// tool's answer, with the assistant message sent back as edit leaves it.
// It returns both replies.
func toolLoop(t *testing.T, p *qwen3policy.Policy, model string, edit func(map[string]json.RawMessage)) (first, second *reply) {
	t.Helper()
	messages := []any{
		map[string]any{"role": "system", "content": "Use the multiply tool when arithmetic is required."},
		map[string]any{"role": "user", "content": "What is 3 times 4?"},
	}
	body := map[string]any{"model": model, "messages": messages, "tools": []any{multiplyTool}, "return_token_ids": true, "logprobs": true}
	first, _ = chat(t, p, body)
	msg := first.Choices[0].Message
	var calls []struct {
		ID       string `json:"id"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	}
	if err := json.Unmarshal(msg["tool_calls"], &calls); err != nil || len(calls) != 1 {
		t.Fatalf("first call: tool_calls %s, want one call (%v)", msg["tool_calls"], err)
	}
	if calls[0].Function.Name != "multiply" || calls[0].Function.Arguments != `{"a": 3, "b": 4}` {
		t.Fatalf("first call: %+v, want multiply with the parser's {\"a\": 3, \"b\": 4}", calls[0])
	}
	if first.Choices[0].FinishReason != "tool_calls" {
		t.Fatalf("first call: finish_reason %q, want tool_calls", first.Choices[0].FinishReason)
	}
	if edit != nil {
		edit(msg)
	}
	body["messages"] = append(messages, msg, map[string]any{"role": "tool", "tool_call_id": calls[0].ID, "content": "12"})
	second, _ = chat(t, p, body)
	var content string
	_ = json.Unmarshal(second.Choices[0].Message["content"], &content)
	if !strings.Contains(content, "12") || second.Choices[0].FinishReason != "stop" {
		t.Fatalf("second call: content %q finish %q, want the tool's result and stop", content, second.Choices[0].FinishReason)
	}
	return first, second
}

// parting is where the second prompt leaves the first prompt followed by
// the first completion, as the replies give them: the index into that
// sequence, or -1 when the second prompt extends it.
func parting(first, second *reply) int {
	return qwen3policy.PartsAt(
		qwen3policy.Call{PromptIDs: first.promptIDs(), CompletionIDs: first.tokenIDs()},
		qwen3policy.Call{PromptIDs: second.promptIDs()},
	)
}

func TestPlainToolLoopReRendersAsExactPrefix(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	first, second := toolLoop(t, p, "qwen3-plain", nil)
	ids := first.tokenIDs()
	if len(ids) == 0 || ids[len(ids)-1] != qwen3policy.IMEnd {
		t.Fatalf("completion %v does not end with <|im_end|>", ids)
	}
	if i := parting(first, second); i != -1 {
		t.Fatalf("second prompt parts from the first prompt + completion at %d; want it to extend them", i)
	}
	if len(second.promptIDs()) <= len(first.promptIDs())+len(ids) {
		t.Fatalf("second prompt (%d ids) is no longer than the first exchange (%d)", len(second.promptIDs()), len(first.promptIDs())+len(ids))
	}

	calls := record(t, p)
	if len(calls) != 2 {
		t.Fatalf("record has %d calls, want 2", len(calls))
	}
	if at := qwen3policy.PartsAt(calls[0], calls[1]); at != -1 {
		t.Fatalf("recorded calls part at %d", at)
	}
	for i, r := range []*reply{first, second} {
		c := calls[i]
		if !slices.Equal(c.PromptIDs, r.promptIDs()) || !slices.Equal(c.CompletionIDs, r.tokenIDs()) {
			t.Errorf("call %d: record's ids differ from the reply's", i)
		}
		if c.Scenario != "plain" || !c.AskedTokenIDs || !c.AskedLogprobs || c.Status != http.StatusOK {
			t.Errorf("call %d: record %+v", i, c)
		}
		if !strings.HasSuffix(c.Prompt, "<|im_start|>assistant\n") {
			t.Errorf("call %d: prompt does not end with the generation prompt: %q", i, c.Prompt)
		}
	}
	if want := "<tool_call>\n{\"name\": \"multiply\", \"arguments\": {\"a\": 3, \"b\": 4}}\n</tool_call>"; calls[0].Completion != want {
		t.Errorf("completion %q, want %q", calls[0].Completion, want)
	}
}

func TestReasoningDroppedPartsAtTheGenerationPrompt(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	first, second := toolLoop(t, p, "qwen3-reasoning", func(m map[string]json.RawMessage) {
		if _, ok := m["reasoning"]; !ok {
			t.Fatalf("first reply has no reasoning: %v", m)
		}
		delete(m, "reasoning")
	})
	// The re-render writes the content the parser left ("\n\n") and the
	// template's "\n" before <tool_call> right after the generation prompt's
	// "assistant\n": the four newlines tokenize as one, so the sequences part
	// one token before the completion, at that prompt's last token.
	at := parting(first, second)
	if at != len(first.promptIDs())-1 {
		t.Fatalf("parted at %d, want %d: the generation prompt's last token", at, len(first.promptIDs())-1)
	}
	if got := first.tokenIDs()[0]; got != qwen3policy.ThinkStart {
		t.Fatalf("first completion token %d, want <think> (%d)", got, qwen3policy.ThinkStart)
	}
	if slices.Contains(second.promptIDs()[len(first.promptIDs()):], qwen3policy.ThinkStart) {
		t.Fatal("the re-render kept the dropped reasoning")
	}
	calls := record(t, p)
	if !strings.Contains(calls[1].Prompt, "<|im_start|>assistant\n\n\n\n<tool_call>") {
		t.Fatalf("second prompt %q", calls[1].Prompt)
	}
}

func TestReasoningSentBackPartsAfterThink(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	first, second := toolLoop(t, p, "qwen3-reasoning", nil)
	at := parting(first, second)
	end := len(first.promptIDs()) + slices.Index(first.tokenIDs(), qwen3policy.ThinkEnd)
	// The template writes the reasoning back, but the "\n\n" content the
	// parser left plus its own "\n" before <tool_call> tokenize otherwise.
	if at != end+1 {
		t.Fatalf("parted at %d, want %d: right after </think>", at, end+1)
	}
}

func TestReserializedArgumentsPartInsideTheToolCall(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	first, second := toolLoop(t, p, "qwen3-reserialize", nil)
	at := parting(first, second) - len(first.promptIDs())
	ids := first.tokenIDs()
	start, end := slices.Index(ids, qwen3policy.ToolCallStart), slices.Index(ids, qwen3policy.ToolCallEnd)
	if at <= start || at >= end {
		t.Fatalf("parted at completion token %d, want inside the tool call (%d, %d)", at, start, end)
	}
	calls := record(t, p)
	if got := qwen3policy.PartsAt(calls[0], calls[1]); got != at+len(first.promptIDs()) {
		t.Fatalf("recorded calls part at %d, the replies at %d", got, at+len(first.promptIDs()))
	}
	if !strings.Contains(calls[0].Completion, `"arguments": {"a":3,"b":4}`) {
		t.Fatalf("completion %q does not write compact arguments", calls[0].Completion)
	}
	if !strings.Contains(calls[1].Prompt, `"arguments": {"a": 3, "b": 4}`) {
		t.Fatalf("second prompt does not re-render the arguments: %q", calls[1].Prompt)
	}
}

func TestNoThinkPartsAtTheEmptyThinkBlock(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	first, second := toolLoop(t, p, "qwen3-nothink", nil)
	prompt := first.promptIDs()
	// The generation prompt ends <think>\n\n</think>\n\n; the re-render of
	// that turn leaves the block out.
	at := slices.Index(prompt, qwen3policy.ThinkStart)
	if at < 0 || prompt[len(prompt)-2] != qwen3policy.ThinkEnd {
		t.Fatalf("generation prompt has no empty think block: %v", prompt[len(prompt)-6:])
	}
	if got := parting(first, second); got != at {
		t.Fatalf("parted at %d, want %d: the generation prompt's <think>", got, at)
	}
}

func TestEnableThinkingFalseTurnsReasoningOff(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{Scenario: "reasoning"})
	r, _ := chat(t, p, map[string]any{
		"messages":             []any{map[string]any{"role": "user", "content": "What is 6 times 7?"}},
		"tools":                []any{multiplyTool},
		"chat_template_kwargs": map[string]any{"enable_thinking": false},
		"return_token_ids":     true,
	})
	if slices.Contains(r.tokenIDs(), qwen3policy.ThinkStart) {
		t.Fatalf("completion %v thinks with enable_thinking false", r.tokenIDs())
	}
	if _, ok := r.Choices[0].Message["reasoning"]; !ok || string(r.Choices[0].Message["reasoning"]) != "null" {
		t.Fatalf("reasoning %s, want null", r.Choices[0].Message["reasoning"])
	}
	calls := record(t, p)
	if calls[0].EnableThinking || calls[0].Scenario != "reasoning" || !strings.HasSuffix(calls[0].Prompt, "<think>\n\n</think>\n\n") {
		t.Fatalf("record %+v", calls[0])
	}
}

func TestTokensOnlyWhenAsked(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{Scenario: "reasoning"})
	messages := []any{map[string]any{"role": "user", "content": "What is 3 times 4?"}}
	for _, tc := range []struct {
		name          string
		ids, logprobs bool
	}{{"neither", false, false}, {"logprobs", false, true}, {"ids", true, false}, {"both", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			body := map[string]any{"messages": messages, "tools": []any{multiplyTool}}
			if tc.ids {
				body["return_token_ids"] = true
			}
			if tc.logprobs {
				body["logprobs"] = true
			}
			r, _ := chat(t, p, body)
			calls := record(t, p)
			c := calls[len(calls)-1]
			if got := r.Choices[0].TokenIDs != nil; got != tc.ids {
				t.Errorf("token_ids given %v, want %v", got, tc.ids)
			}
			if got := r.PromptTokenIDs != nil; got != tc.ids {
				t.Errorf("prompt_token_ids given %v, want %v", got, tc.ids)
			}
			if got := r.Choices[0].Logprobs != nil; got != tc.logprobs {
				t.Fatalf("logprobs given %v, want %v", got, tc.logprobs)
			}
			if tc.ids && (!slices.Equal(r.tokenIDs(), c.CompletionIDs) || !slices.Equal(r.promptIDs(), c.PromptIDs)) {
				t.Errorf("ids differ from the record")
			}
			if r.Usage.PromptTokens != len(c.PromptIDs) || r.Usage.CompletionTokens != len(c.CompletionIDs) || r.Usage.TotalTokens != len(c.PromptIDs)+len(c.CompletionIDs) {
				t.Errorf("usage %+v, want %d + %d", r.Usage, len(c.PromptIDs), len(c.CompletionIDs))
			}
			if !tc.logprobs {
				return
			}
			content := r.Choices[0].Logprobs.Content
			if len(content) != len(c.CompletionIDs) {
				t.Fatalf("%d logprobs for %d tokens", len(content), len(c.CompletionIDs))
			}
			var text strings.Builder
			for i, lp := range content {
				text.WriteString(lp.Token)
				if lp.Logprob != c.Logprobs[i] || lp.Logprob >= 0 || lp.Logprob < -100 {
					t.Errorf("logprob %d: %v (record %v)", i, lp.Logprob, c.Logprobs[i])
				}
				if string(lp.Bytes) != lp.Token {
					t.Errorf("logprob %d: bytes %q of token %q", i, lp.Bytes, lp.Token)
				}
			}
			if want := c.Completion + "<|im_end|>"; text.String() != want {
				t.Errorf("token strings spell %q, want %q", text.String(), want)
			}
		})
	}
}

func TestLogprobsAreDeterministic(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	body := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "What is 3 times 4?"}}, "tools": []any{multiplyTool}, "logprobs": true, "return_token_ids": true}
	a, _ := chat(t, p, body)
	b, _ := chat(t, p, body)
	if !slices.Equal(a.tokenIDs(), b.tokenIDs()) || !slices.EqualFunc(a.Choices[0].Logprobs.Content, b.Choices[0].Logprobs.Content, logprob.equal) {
		t.Fatal("the same request got other tokens or logprobs")
	}
}

func TestHostedModeRefusesEngineFields(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	messages := []any{map[string]any{"role": "user", "content": "What is 3 times 4?"}}
	resp, data := post(t, p, map[string]any{"model": "qwen3-plain-hosted", "messages": messages, "return_token_ids": true, "logprobs": true})
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("status %s, want 400: %s", resp.Status, data)
	}
	var e struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
		} `json:"error"`
	}
	if err := json.Unmarshal(data, &e); err != nil || e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, "return_token_ids") {
		t.Fatalf("error body %s (%v)", data, err)
	}

	// Asked again without the engine's fields, it answers as OpenAI does:
	// logprobs, no token ids, no vLLM extras.
	r, raw := chat(t, p, map[string]any{"model": "qwen3-plain-hosted", "messages": messages, "logprobs": true})
	var top map[string]json.RawMessage
	if err := json.Unmarshal(raw, &top); err != nil {
		t.Fatal(err)
	}
	if _, ok := top["prompt_token_ids"]; ok || r.Choices[0].TokenIDs != nil || r.Choices[0].Logprobs == nil {
		t.Fatalf("hosted answer %s", raw)
	}
	calls := record(t, p)
	if len(calls) != 2 || calls[0].Status != http.StatusBadRequest || calls[0].Fault != "hosted" || calls[1].Status != http.StatusOK {
		t.Fatalf("record %+v", calls)
	}
}

func TestBadInputIsRefusedWithTheField(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	for _, tc := range []struct {
		name  string
		body  map[string]any
		param string
	}{
		{"no messages", map[string]any{"messages": []any{}}, "messages"},
		{"role missing", map[string]any{"messages": []any{map[string]any{"content": "hi"}}}, "messages[0].role"},
		{"bad arguments", map[string]any{"messages": []any{
			map[string]any{"role": "user", "content": "hi"},
			map[string]any{"role": "assistant", "tool_calls": []any{map[string]any{"id": "x", "type": "function", "function": map[string]any{"name": "f", "arguments": "{"}}}},
		}}, "messages[1].tool_calls[0].function.arguments"},
		{"logprobs not a bool", map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "logprobs": "yes"}, "logprobs"},
		{"n of 2", map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "n": 2}, "n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, data := post(t, p, tc.body)
			var e struct {
				Error struct {
					Param string `json:"param"`
				} `json:"error"`
			}
			if resp.StatusCode != http.StatusBadRequest || json.Unmarshal(data, &e) != nil || e.Error.Param != tc.param {
				t.Fatalf("%s %s, want 400 naming %s", resp.Status, data, tc.param)
			}
		})
	}
}

// streamed is a streamed completion put together.
type streamed struct {
	promptIDs, tokenIDs []int
	logprobs            []logprob
	content, reasoning  string
	toolCalls           []map[string]any
	finishReason        string
	usage               map[string]int
	done                bool
}

// stream sends body with stream set and reads the events until [DONE] or
// the end of the body; err is the read error of a body cut short.
func stream(t *testing.T, p *qwen3policy.Policy, body map[string]any) (s streamed, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
	defer cancel()
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.URL()+"/chat/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %s, content type %q", resp.Status, resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			s.done = true
			continue
		}
		var chunk struct {
			PromptTokenIDs []int `json:"prompt_token_ids"`
			Choices        []struct {
				Delta struct {
					Content   string           `json:"content"`
					Reasoning string           `json:"reasoning"`
					ToolCalls []map[string]any `json:"tool_calls"`
				} `json:"delta"`
				TokenIDs     []int   `json:"token_ids"`
				FinishReason *string `json:"finish_reason"`
				Logprobs     *struct {
					Content []logprob `json:"content"`
				} `json:"logprobs"`
			} `json:"choices"`
			Usage map[string]int `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		s.promptIDs = append(s.promptIDs, chunk.PromptTokenIDs...)
		if chunk.Usage != nil {
			s.usage = chunk.Usage
		}
		for _, c := range chunk.Choices {
			s.tokenIDs = append(s.tokenIDs, c.TokenIDs...)
			s.content += c.Delta.Content
			s.reasoning += c.Delta.Reasoning
			for _, d := range c.Delta.ToolCalls {
				s.addToolCall(t, d)
			}
			if c.Logprobs != nil {
				s.logprobs = append(s.logprobs, c.Logprobs.Content...)
			}
			if c.FinishReason != nil {
				s.finishReason = *c.FinishReason
			}
		}
	}
	return s, sc.Err()
}

// addToolCall merges a tool-call delta into the calls so far: the first
// delta of an index carries its id, type and name, later ones add to its
// arguments.
func (s *streamed) addToolCall(t *testing.T, d map[string]any) {
	t.Helper()
	i, ok := d["index"].(float64)
	if !ok || int(i) > len(s.toolCalls) {
		t.Fatalf("tool call delta %v out of order", d)
	}
	fn, _ := d["function"].(map[string]any)
	if int(i) == len(s.toolCalls) {
		if d["id"] == nil || d["type"] != "function" || fn["name"] == nil {
			t.Fatalf("first delta of a tool call %v lacks its id, type or name", d)
		}
		s.toolCalls = append(s.toolCalls, map[string]any{"id": d["id"], "function": map[string]any{"name": fn["name"], "arguments": ""}})
	}
	if args, ok := fn["arguments"].(string); ok {
		f := s.toolCalls[int(i)]["function"].(map[string]any)
		f["arguments"] = f["arguments"].(string) + args
	}
}

func TestStreamGivesWhatJSONGives(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	for _, scenario := range qwen3policy.Scenarios {
		t.Run(scenario, func(t *testing.T) {
			body := func() map[string]any {
				return map[string]any{
					"model":            "qwen3-" + scenario,
					"messages":         []any{map[string]any{"role": "user", "content": "What is 3 times 4?"}},
					"tools":            []any{multiplyTool},
					"return_token_ids": true,
					"logprobs":         true,
				}
			}
			j, _ := chat(t, p, body())
			s, err := stream(t, p, body())
			if err != nil || !s.done {
				t.Fatalf("stream ended early (done %v): %v", s.done, err)
			}
			if !slices.Equal(s.promptIDs, j.promptIDs()) || !slices.Equal(s.tokenIDs, j.tokenIDs()) {
				t.Fatalf("stream ids\n%v\n%v\nJSON ids\n%v\n%v", s.promptIDs, s.tokenIDs, j.promptIDs(), j.tokenIDs())
			}
			if !slices.EqualFunc(s.logprobs, j.Choices[0].Logprobs.Content, logprob.equal) {
				t.Fatal("stream logprobs differ from JSON's")
			}
			msg := j.Choices[0].Message
			var content, reasoning *string
			_ = json.Unmarshal(msg["content"], &content)
			_ = json.Unmarshal(msg["reasoning"], &reasoning)
			if s.content != deref(content) || s.reasoning != deref(reasoning) {
				t.Fatalf("stream content %q reasoning %q, JSON %q %q", s.content, s.reasoning, deref(content), deref(reasoning))
			}
			var calls []map[string]any
			_ = json.Unmarshal(msg["tool_calls"], &calls)
			if len(s.toolCalls) != 1 || len(calls) != 1 {
				t.Fatalf("tool calls: stream %v JSON %v", s.toolCalls, calls)
			}
			fs, fj := s.toolCalls[0]["function"].(map[string]any), calls[0]["function"].(map[string]any)
			if fs["name"] != fj["name"] || fs["arguments"] != fj["arguments"] || s.toolCalls[0]["id"] == "" {
				t.Fatalf("tool call: stream %v JSON %v", s.toolCalls[0], calls[0])
			}
			if s.finishReason != j.Choices[0].FinishReason {
				t.Fatalf("finish %q, JSON %q", s.finishReason, j.Choices[0].FinishReason)
			}
			if s.usage["prompt_tokens"] != len(s.promptIDs) || s.usage["completion_tokens"] != len(s.tokenIDs) || s.usage["total_tokens"] != len(s.promptIDs)+len(s.tokenIDs) {
				t.Fatalf("usage %v for %d + %d", s.usage, len(s.promptIDs), len(s.tokenIDs))
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

// TestFaultsHitCallsAfterAToolResult runs a tool loop under each fault: the
// first call is clean, the second is not.
func TestFaultsHitCallsAfterAToolResult(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	messages := []any{
		map[string]any{"role": "user", "content": "What is 3 times 4?"},
		map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
			"id": "call-1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a": 3, "b": 4}`},
		}}},
		map[string]any{"role": "tool", "tool_call_id": "call-1", "content": "12"},
	}
	body := func(fault string, turns int) map[string]any {
		return map[string]any{"model": "qwen3-plain-" + fault, "messages": messages[:turns], "tools": []any{multiplyTool}, "return_token_ids": true, "logprobs": true}
	}
	for _, fault := range []string{"badlen", "badid", "noids"} {
		t.Run(fault, func(t *testing.T) {
			clean, _ := chat(t, p, body(fault, 1))
			if len(clean.tokenIDs()) != len(clean.Choices[0].Logprobs.Content) || slices.Contains(clean.tokenIDs(), qwen3policy.OutOfVocabID) {
				t.Fatalf("first call is faulty: %v", clean.tokenIDs())
			}
			r, _ := chat(t, p, body(fault, 3))
			calls := record(t, p)
			c := calls[len(calls)-1]
			if c.Fault != fault {
				t.Fatalf("record fault %q, want %q", c.Fault, fault)
			}
			n := len(r.Choices[0].Logprobs.Content)
			switch fault {
			case "badlen":
				if len(r.tokenIDs()) != n-1 {
					t.Fatalf("%d ids for %d logprobs, want one fewer", len(r.tokenIDs()), n)
				}
			case "badid":
				if r.tokenIDs()[0] != qwen3policy.OutOfVocabID || r.tokenIDs()[0] < qwen3policy.VocabSize {
					t.Fatalf("ids %v, want the first out of the vocabulary", r.tokenIDs())
				}
			case "noids":
				if r.Choices[0].TokenIDs != nil || r.PromptTokenIDs != nil {
					t.Fatal("ids given under noids")
				}
			}
			// The record keeps what was really generated.
			if len(c.CompletionIDs) != n || c.CompletionIDs[n-1] != qwen3policy.IMEnd {
				t.Fatalf("record ids %v", c.CompletionIDs)
			}
		})
	}
	t.Run("cut", func(t *testing.T) {
		s, err := stream(t, p, body("cut", 1))
		if err != nil || !s.done {
			t.Fatalf("first call cut: %v", err)
		}
		s, err = stream(t, p, body("cut", 3))
		if s.done || s.finishReason != "" {
			t.Fatalf("stream cut short came to an end: %+v", s)
		}
		if !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("read error %v, want an unexpected EOF", err)
		}
		if len(s.tokenIDs) == 0 {
			t.Fatal("the stream was cut before any token")
		}
	})
}

func TestModelsAndHealth(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
	defer cancel()
	for _, u := range []string{p.Addr() + "/health", p.URL() + "/models"} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %s", u, resp.Status)
		}
		if strings.HasSuffix(u, "/models") && !strings.Contains(string(data), `"qwen3-reasoning"`) {
			t.Fatalf("models %s", data)
		}
	}
	if err := p.Reset(ctx); err != nil {
		t.Fatal(err)
	}
	if calls := record(t, p); len(calls) != 0 {
		t.Fatalf("record after reset: %v", calls)
	}
}

func TestToolArgumentsFollowTheParameters(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	// The properties are written in the order given (a Go map would sort them).
	tool := func(name string, props ...string) map[string]any {
		var properties []string
		for i := 0; i < len(props); i += 2 {
			properties = append(properties, strconv.Quote(props[i])+`: {"type": `+strconv.Quote(props[i+1])+`}`)
		}
		params := json.RawMessage(`{"type": "object", "properties": {` + strings.Join(properties, ", ") + `}}`)
		return map[string]any{"type": "function", "function": map[string]any{"name": name, "parameters": params}}
	}
	calculator := []any{tool("add", "a", "number", "b", "number"), tool("multiply", "a", "number", "b", "number")}
	for _, tc := range []struct {
		name, prompt string
		tools        []any
		tool, args   string
	}{
		{"multiply", "What is 3 times 4?", []any{multiplyTool}, "multiply", `{"a": 3, "b": 4}`},
		{"the first operator's tool", "What is 7 * 8 + 1?", calculator, "multiply", `{"a": 7, "b": 8}`},
		{"the first tool", "Take 7 and 8.", calculator, "add", `{"a": 7, "b": 8}`},
		{"parameters in their order", "What is 5 plus 9?", []any{tool("add", "b", "integer", "a", "integer")}, "add", `{"b": 5, "a": 9}`},
		{"an expression", "Calculate 2.5 times (3 + 4).", []any{tool("calculator", "expression", "string")}, "calculator", `{"expression": "2.5 * (3 + 4)"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := chat(t, p, map[string]any{"messages": []any{map[string]any{"role": "user", "content": tc.prompt}}, "tools": tc.tools})
			var calls []struct {
				Function struct{ Name, Arguments string } `json:"function"`
			}
			if err := json.Unmarshal(r.Choices[0].Message["tool_calls"], &calls); err != nil || len(calls) != 1 || calls[0].Function.Name != tc.tool || calls[0].Function.Arguments != tc.args {
				t.Fatalf("tool_calls %s, want %s with %s", r.Choices[0].Message["tool_calls"], tc.tool, tc.args)
			}
		})
	}
}

// TestOpenAIClientReadsBothShapes drives the policy with openai-go, as
// osmo's workflows do: the tool call and the extra fields come through the
// JSON reply and the accumulated stream alike.
func TestOpenAIClientReadsBothShapes(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
	defer cancel()
	client := openai.NewClient(option.WithBaseURL(p.URL()), option.WithAPIKey("k"), option.WithMaxRetries(0))
	params := openai.ChatCompletionNewParams{
		Model:    "qwen3-reasoning",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("What is 3 times 4?")},
		Tools: []openai.ChatCompletionToolUnionParam{openai.ChatCompletionFunctionTool(openai.FunctionDefinitionParam{
			Name:       "multiply",
			Parameters: openai.FunctionParameters{"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}}},
		})},
	}
	params.SetExtraFields(map[string]any{"return_token_ids": true})
	got, err := client.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	s := client.Chat.Completions.NewStreaming(ctx, params)
	var acc openai.ChatCompletionAccumulator
	for s.Next() {
		acc.AddChunk(s.Current())
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]*openai.ChatCompletion{"json": got, "stream": &acc.ChatCompletion} {
		m := c.Choices[0].Message
		if len(m.ToolCalls) != 1 || m.ToolCalls[0].Function.Name != "multiply" || m.ToolCalls[0].Function.Arguments != `{"a": 3, "b": 4}` || !strings.HasPrefix(m.ToolCalls[0].ID, "chatcmpl-tool-") {
			t.Errorf("%s: tool calls %+v", name, m.ToolCalls)
		}
		if m.Content != "\n\n" || c.Choices[0].FinishReason != "tool_calls" {
			t.Errorf("%s: content %q finish %q", name, m.Content, c.Choices[0].FinishReason)
		}
	}
	if !strings.Contains(got.RawJSON(), `"prompt_token_ids":[`) || !strings.Contains(got.Choices[0].Message.RawJSON(), `"reasoning":"\nThe user`) {
		t.Errorf("JSON reply lacks the engine's fields: %s", got.RawJSON())
	}
}

func TestMaxTokensCutsTheCompletion(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{Scenario: "reasoning"})
	r, _ := chat(t, p, map[string]any{
		"messages":         []any{map[string]any{"role": "user", "content": "What is 3 times 4?"}},
		"tools":            []any{multiplyTool},
		"max_tokens":       3,
		"return_token_ids": true,
	})
	ids := r.tokenIDs()
	if len(ids) != 3 || slices.Contains(ids, qwen3policy.IMEnd) || r.Choices[0].FinishReason != "length" || r.Usage.CompletionTokens != 3 {
		t.Fatalf("ids %v finish %q usage %+v, want 3 tokens without a stop and length", ids, r.Choices[0].FinishReason, r.Usage)
	}
	if string(r.Choices[0].Message["tool_calls"]) != "[]" {
		t.Fatalf("tool calls %s from a cut completion", r.Choices[0].Message["tool_calls"])
	}
}

func TestLogprobsNameTokensByIDWhenAsked(t *testing.T) {
	p := qwen3policy.Start(t, qwen3policy.Options{})
	_, raw := chat(t, p, map[string]any{
		"messages":                   []any{map[string]any{"role": "user", "content": "What is 3 times 4?"}},
		"tools":                      []any{multiplyTool},
		"logprobs":                   true,
		"top_logprobs":               2,
		"return_tokens_as_token_ids": true,
	})
	var r struct {
		Choices []struct {
			Logprobs struct {
				Content []struct {
					logprob
					TopLogprobs []logprob `json:"top_logprobs"`
				} `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		t.Fatal(err)
	}
	ids := record(t, p)[0].CompletionIDs
	content := r.Choices[0].Logprobs.Content
	if len(content) != len(ids) {
		t.Fatalf("%d logprobs for %d ids", len(content), len(ids))
	}
	for i, e := range content {
		if want := "token_id:" + strconv.Itoa(ids[i]); e.Token != want || len(e.TopLogprobs) != 2 || !e.TopLogprobs[0].equal(e.logprob) || e.TopLogprobs[1].Logprob >= e.Logprob {
			t.Fatalf("entry %d: %+v, want token %s with two alternatives, itself first", i, e, want)
		}
	}
}
