package llmproxy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// TestResponsesRequestTranslated checks what the policy receives for a
// Responses call: a chat completion carrying the same conversation, tools
// and sampling settings.
func TestResponsesRequestTranslated(t *testing.T) {
	up := newUpstream(t, okJSON)
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1"})})
	body := `{
	  "model": "openai/osmosis-rollout",
	  "instructions": "You are a calculator.",
	  "input": [
	    {"role": "user", "content": [{"type": "input_text", "text": "What is 3 * 4?"}]},
	    {"type": "reasoning", "id": "rs_1", "summary": []},
	    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
	     "content": [{"type": "output_text", "text": "Let me multiply.", "annotations": []}]},
	    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "multiply", "arguments": "{\"a\":3,\"b\":4}", "status": "completed"},
	    {"type": "function_call_output", "call_id": "call_1", "output": "12"},
	    {"role": "developer", "content": "Answer with the number only."},
	    {"type": "function_call", "call_id": "call_2", "name": "multiply", "arguments": "{\"a\":12,\"b\":1}"},
	    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "12"}]}
	  ],
	  "tools": [{"type": "function", "name": "multiply", "description": "Multiply two integers.",
	             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}, "strict": null}],
	  "tool_choice": "auto",
	  "parallel_tool_calls": false,
	  "temperature": 0.7,
	  "max_output_tokens": 64,
	  "reasoning": {"effort": "low"},
	  "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": true}},
	  "store": false, "include": ["reasoning.encrypted_content"], "truncation": "disabled",
	  "return_token_ids": true
	}`
	resp, got := post(t, h.url+"/v1/responses", body, ids)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	req := up.only(t)
	if req.path != "/v1/chat/completions" {
		t.Errorf("upstream path = %q, want /v1/chat/completions", req.path)
	}
	jsonEqual(t, "upstream body", req.body, `{
	  "model": "policy-v1",
	  "messages": [
	    {"role": "system", "content": "You are a calculator."},
	    {"role": "user", "content": "What is 3 * 4?"},
	    {"role": "assistant", "content": "Let me multiply.",
	     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": "{\"a\":3,\"b\":4}"}}]},
	    {"role": "tool", "tool_call_id": "call_1", "content": "12"},
	    {"role": "system", "content": "Answer with the number only."},
	    {"role": "assistant", "content": null,
	     "tool_calls": [{"id": "call_2", "type": "function", "function": {"name": "multiply", "arguments": "{\"a\":12,\"b\":1}"}}]},
	    {"role": "tool", "tool_call_id": "call_2", "content": "12"}
	  ],
	  "tools": [{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
	             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}],
	  "tool_choice": "auto",
	  "parallel_tool_calls": false,
	  "temperature": 0.7,
	  "max_tokens": 64,
	  "reasoning_effort": "low",
	  "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": true}},
	  "return_token_ids": true
	}`)
	for _, k := range []string{"X-Rollout-Id", "X-Sample-Id"} {
		if req.header.Get(k) == "" {
			t.Errorf("upstream call lacks %s", k)
		}
	}
	c := h.next(t)
	if c.API != llmproxy.APIResponses || c.RequestedModel != "openai/osmosis-rollout" || c.Model != "policy-v1" {
		t.Errorf("record: api %q requested %q model %q", c.API, c.RequestedModel, c.Model)
	}
	var msgs []map[string]any
	if err := json.Unmarshal([]byte(mustJSON(t, c.RequestMessages)), &msgs); err != nil || len(msgs) != 7 {
		t.Errorf("recorded request messages = %s (%v), want the 7 chat messages sent upstream", c.RequestMessages, err)
	}
}

// toolTurnJSON is a completion with reasoning, text and two tool calls.
const toolTurnJSON = `{"id":"chatcmpl-tt","object":"chat.completion","created":1,"model":"policy-v1",
 "choices":[{"index":0,"finish_reason":"tool_calls","message":{"role":"assistant","content":"Multiplying.","reasoning_content":"3 times 4",
  "tool_calls":[{"id":"call_a","type":"function","function":{"name":"multiply","arguments":"{\"a\":3,\"b\":4}"}},
                {"id":"call_b","type":"function","function":{"name":"multiply","arguments":"{\"a\":5,\"b\":6}"}}]}}],
 "usage":{"prompt_tokens":30,"completion_tokens":12,"total_tokens":42,"prompt_tokens_details":{"cached_tokens":8}}}`

func openaiClient(baseURL string) openai.Client {
	return openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey("k"), option.WithMaxRetries(0),
		option.WithRequestTimeout(testTimeout))
}

// TestResponsesJSON drives the proxy with openai-go's Responses client and
// checks the Response object it decodes.
func TestResponsesJSON(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, toolTurnJSON)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	client := openaiClient(h.url + "/r/r1/s/s1/v1/")
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	r, err := client.Responses.New(ctx, responses.ResponseNewParams{
		Model: "openai/osmosis-rollout",
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("What is 3 * 4 and 5 * 6?")},
	})
	if err != nil {
		t.Fatalf("Responses.New: %v", err)
	}
	if r.Status != "completed" || r.Usage.InputTokens != 30 || r.Usage.OutputTokens != 12 || r.Usage.TotalTokens != 42 ||
		r.Usage.InputTokensDetails.CachedTokens != 8 || !strings.HasPrefix(r.ID, "resp_") {
		t.Errorf("response: id %q status %q usage %+v", r.ID, r.Status, r.Usage)
	}
	if got := r.OutputText(); got != "Multiplying." {
		t.Errorf("OutputText = %q", got)
	}
	var types []string
	var calls []string
	for _, item := range r.Output {
		types = append(types, item.Type)
		if item.Type == "function_call" {
			calls = append(calls, item.CallID+" "+item.Name+" "+item.Arguments.OfString)
		}
	}
	if strings.Join(types, ",") != "reasoning,message,function_call,function_call" {
		t.Errorf("output item types = %v", types)
	}
	if strings.Join(calls, "|") != `call_a multiply {"a":3,"b":4}|call_b multiply {"a":5,"b":6}` {
		t.Errorf("function calls = %q", calls)
	}
	jsonEqual(t, "upstream messages", messagesOf(t, up.only(t).body), `[{"role":"user","content":"What is 3 * 4 and 5 * 6?"}]`)
	c := h.next(t)
	if c.RolloutID != "r1" || c.SampleID != "s1" || c.FinishReason != "tool_calls" || c.Usage.PromptTokens != 30 || c.StatusCode != 200 {
		t.Errorf("record: %+v", c)
	}
}

func messagesOf(t *testing.T, body []byte) []byte {
	t.Helper()
	var b struct {
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatal(err)
	}
	return b.Messages
}

// TestResponsesStream streams a turn through openai-go's streaming client:
// text deltas arrive live, function calls whole, and response.completed
// carries the output and usage.
func TestResponsesStream(t *testing.T) {
	release := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Stream        bool `json:"stream"`
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		body, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(body, &req); err != nil || !req.Stream || !req.StreamOptions.IncludeUsage {
			http.Error(w, "want stream with include_usage: "+string(body), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		send := func(data string) {
			_, _ = io.WriteString(w, "data: "+data+"\n\n")
			w.(http.Flusher).Flush()
		}
		send(`{"id":"chatcmpl-s","choices":[{"index":0,"delta":{"role":"assistant","content":"Multi"}}]}`)
		// The rest waits until the client has seen the first delta.
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		send(`{"id":"chatcmpl-s","choices":[{"index":0,"delta":{"content":"plying."}}]}`)
		send(`{"id":"chatcmpl-s","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"multiply","arguments":"{\"a\":"}}]}}]}`)
		send(`{"id":"chatcmpl-s","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"3,\"b\":4}"}}]}}]}`)
		send(`{"id":"chatcmpl-s","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}`)
		send(`{"id":"chatcmpl-s","choices":[],"usage":{"prompt_tokens":20,"completion_tokens":9,"total_tokens":29}}`)
		send(`[DONE]`)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	client := openaiClient(h.url + "/r/r1/s/s1/v1/")
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	stream := client.Responses.NewStreaming(ctx, responses.ResponseNewParams{
		Model: "openai/osmosis-rollout",
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("What is 3 * 4?")},
	})
	defer stream.Close()
	var (
		types     []string
		text      string
		completed responses.Response
		args      string
		seq       int64 = -1
	)
	for stream.Next() {
		ev := stream.Current()
		if ev.SequenceNumber != seq+1 {
			t.Errorf("%s has sequence_number %d after %d", ev.Type, ev.SequenceNumber, seq)
		}
		seq = ev.SequenceNumber
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			text += ev.Delta
			if text == "Multi" {
				close(release) // the first delta came through before the upstream went on
			}
		case "response.function_call_arguments.done":
			args = ev.Arguments
		case "response.completed":
			completed = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	want := []string{
		"response.created", "response.in_progress",
		"response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
		"response.output_text.done", "response.content_part.done", "response.output_item.done",
		"response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
		"response.completed",
	}
	if strings.Join(types, " ") != strings.Join(want, " ") {
		t.Errorf("events =\n%v\nwant\n%v", types, want)
	}
	if text != "Multiplying." || args != `{"a":3,"b":4}` {
		t.Errorf("text %q, arguments %q", text, args)
	}
	if completed.Status != "completed" || completed.OutputText() != "Multiplying." || completed.Usage.TotalTokens != 29 || len(completed.Output) != 2 {
		t.Errorf("completed response: status %q text %q usage %+v output %d items", completed.Status, completed.OutputText(), completed.Usage, len(completed.Output))
	}
	c := h.next(t)
	if !c.Stream || c.API != llmproxy.APIResponses || c.Usage.CompletionTokens != 9 || c.TimeToFirstTokenMS <= 0 {
		t.Errorf("record: %+v", c)
	}
	jsonEqual(t, "recorded message", c.ResponseMessage,
		`{"role":"assistant","content":"Multiplying.","tool_calls":[{"id":"call_a","type":"function","function":{"name":"multiply","arguments":"{\"a\":3,\"b\":4}"}}]}`)
}

// TestResponsesLengthIsIncomplete maps a turn cut by max tokens to an
// incomplete Response, as the Responses API reports it.
func TestResponsesLengthIsIncomplete(t *testing.T) {
	cut := `{"id":"chatcmpl-c","choices":[{"index":0,"message":{"role":"assistant","content":"The ans"},"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}`
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(readAll(r), `"stream":true`) {
			sseHandler("\n", `{"id":"chatcmpl-c","choices":[{"index":0,"delta":{"content":"The ans"},"finish_reason":"length"}]}`, "[DONE]")(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, cut)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	resp, body := post(t, h.url+"/v1/responses", `{"input":"Answer at length.","max_output_tokens":3}`, ids)
	var r struct {
		Status            string `json:"status"`
		IncompleteDetails struct {
			Reason string `json:"reason"`
		} `json:"incomplete_details"`
		MaxOutputTokens int `json:"max_output_tokens"`
	}
	if err := json.Unmarshal(body, &r); err != nil || resp.StatusCode != 200 || r.Status != "incomplete" ||
		r.IncompleteDetails.Reason != "max_output_tokens" || r.MaxOutputTokens != 3 {
		t.Errorf("JSON answer %d: %s", resp.StatusCode, body)
	}
	_, body = post(t, h.url+"/v1/responses", `{"input":"Answer at length.","stream":true}`, ids)
	if last := lastEvent(t, string(body)); !strings.HasPrefix(last, "event: response.incomplete\n") || !strings.Contains(last, `"reason":"max_output_tokens"`) {
		t.Errorf("stream ended with %q", last)
	}
}

// TestResponsesStreamBreaks ends a broken stream with response.failed, so
// the client fails with the cause rather than waiting for a terminal event.
func TestResponsesStreamBreaks(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"par"}}]}`+"\n\n")
		w.(http.Flusher).Flush()
		hijackClose(t, w)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	resp, body := post(t, h.url+"/v1/responses", `{"input":"hi","stream":true}`, ids)
	last := lastEvent(t, string(body))
	if resp.StatusCode != 200 || !strings.HasPrefix(last, "event: response.failed\n") || !strings.Contains(last, "upstream stream broke") {
		t.Errorf("stream (%d) ended with %q", resp.StatusCode, last)
	}
	if c := h.next(t); !strings.Contains(c.Error, "broke") {
		t.Errorf("record error = %q", c.Error)
	}
}

// TestResponsesBadInput refuses what a stateless proxy in front of a chat
// completions policy cannot serve, naming the field, without calling
// upstream.
func TestResponsesBadInput(t *testing.T) {
	up := newUpstream(t, okJSON)
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	tests := []struct {
		name, body, param, code string
	}{
		{"not JSON", `{"input":`, "", "invalid_json"},
		{"not an object", `["hi"]`, "", "invalid_request_body"},
		{"no input", `{"model":"m"}`, "input", "missing_input"},
		{"input not text or items", `{"input":42}`, "input", "invalid_type"},
		{"previous response", `{"input":"hi","previous_response_id":"resp_1"}`, "previous_response_id", "unsupported_parameter"},
		{"conversation", `{"input":"hi","conversation":"conv_1"}`, "conversation", "unsupported_parameter"},
		{"background", `{"input":"hi","background":true}`, "background", "unsupported_parameter"},
		{"hosted tool", `{"input":"hi","tools":[{"type":"web_search"}]}`, "tools[0].type", "unsupported_tool"},
		{"nameless function", `{"input":"hi","tools":[{"type":"function"}]}`, "tools[0].name", "invalid_tool"},
		{"hosted tool item", `{"input":[{"type":"computer_call","call_id":"c"}]}`, "input[0].type", "unsupported_input_item"},
		{"item reference", `{"input":[{"type":"item_reference","id":"msg_1"}]}`, "input[0].type", "unsupported_input_item"},
		{"output without call id", `{"input":[{"type":"function_call_output","output":"1"}]}`, "input[0].call_id", "invalid_input_item"},
		{"bad role", `{"input":[{"role":"robot","content":"hi"}]}`, "input[0].role", "invalid_role"},
		{"image by file id", `{"input":[{"role":"user","content":[{"type":"input_image","file_id":"f"}]}]}`, "input[0].content[0].image_url", "unsupported_content"},
		{"allowed tools choice", `{"input":"hi","tool_choice":{"type":"allowed_tools","mode":"auto","tools":[]}}`, "tool_choice.type", "unsupported_tool_choice"},
		{"text format", `{"input":"hi","text":{"format":{"type":"grammar"}}}`, "text.format.type", "invalid_value"},
		{"stream not bool", `{"input":"hi","stream":"yes"}`, "stream", "invalid_type"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := post(t, h.url+"/v1/responses", tc.body, ids)
			e := decodeError(t, resp, body, http.StatusBadRequest)
			param := ""
			if e.Error.Param != nil {
				param = *e.Error.Param
			}
			if e.Error.Code != tc.code || param != tc.param {
				t.Errorf("code %q param %q, want %q %q: %s", e.Error.Code, param, tc.code, tc.param, e.Error.Message)
			}
			if c := h.next(t); c.API != llmproxy.APIResponses || c.StatusCode != http.StatusBadRequest {
				t.Errorf("record: api %q status %d", c.API, c.StatusCode)
			}
		})
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream got %d requests for bad input", n)
	}
}

// TestResponsesUpstreamRefusal passes a policy's 4xx through unchanged.
func TestResponsesUpstreamRefusal(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"context too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`)
	})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	resp, body := post(t, h.url+"/v1/responses", `{"input":"hi"}`, ids)
	if e := decodeError(t, resp, body, http.StatusBadRequest); e.Error.Code != "context_length_exceeded" {
		t.Errorf("error = %+v", e.Error)
	}
}

func readAll(r *http.Request) string {
	b, _ := io.ReadAll(r.Body)
	return string(b)
}

// lastEvent is the last SSE event of a stream body.
func lastEvent(t *testing.T, body string) string {
	t.Helper()
	var last string
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var cur strings.Builder
	for sc.Scan() {
		if sc.Text() == "" {
			if cur.Len() > 0 {
				last = cur.String()
			}
			cur.Reset()
			continue
		}
		cur.WriteString(sc.Text() + "\n")
	}
	if last == "" {
		t.Fatalf("no events in %q", body)
	}
	return last
}
