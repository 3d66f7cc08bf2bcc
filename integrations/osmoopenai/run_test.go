package osmoopenai_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
)

// toolCallsReply is an assistant message calling each (name, arguments)
// pair, with ids call-0, call-1, ...
func toolCallsReply(t *testing.T, calls ...[2]string) string {
	t.Helper()
	var tcs []map[string]any
	for i, c := range calls {
		tcs = append(tcs, map[string]any{
			"id": "call-" + string(rune('0'+i)), "type": "function",
			"function": map[string]any{"name": c[0], "arguments": c[1]},
		})
	}
	b, err := json.Marshal(map[string]any{"role": "assistant", "content": nil, "tool_calls": tcs})
	if err != nil {
		t.Fatal(err)
	}
	return completion(string(b))
}

// Every way a tool call can go wrong reaches the model as an "Error:" tool
// message, and the loop goes on to the final answer.
func TestRunToolErrorsGoToTheModel(t *testing.T) {
	up := newScripted(t,
		toolCallsReply(t,
			[2]string{"multiply", `{"a":6,"b":7}`},
			[2]string{"divide", `{"a":6,"b":7}`},
			[2]string{"multiply", `{"a":6,`},
			[2]string{"multiply", `[6,7]`},
			[2]string{"fails", `{}`},
			[2]string{"panics", ``},
		),
		completion(`{"role":"assistant","content":"done: 42"}`),
	)
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	var gotArgs json.RawMessage
	tools := []osmoopenai.Tool{
		multiplyTool(),
		{Name: "fails", Call: func(context.Context, json.RawMessage) (string, error) { return "", errors.New("disk on fire") }},
		{Name: "panics", Call: func(_ context.Context, args json.RawMessage) (string, error) {
			gotArgs = args
			panic("oops")
		}},
	}
	resp, err := osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(task)}}, tools, 5)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Choices[0].Message.Content != "done: 42" {
		t.Errorf("final content %q, want the second reply", resp.Choices[0].Message.Content)
	}
	if string(gotArgs) != "{}" {
		t.Errorf("empty arguments reached the tool as %q, want {}", gotArgs)
	}
	items := s.Items()
	if len(items) != 9 {
		t.Fatalf("%d items, want user, assistant, 6 tool messages, assistant: %v", len(items), items)
	}
	wants := []struct{ prefix, contains string }{
		{"42", ""},
		{"Error: ", `unknown tool "divide"`},
		{"Error: ", `invalid arguments for tool "multiply"`},
		{"Error: ", `invalid arguments for tool "multiply"`},
		{"Error: ", "disk on fire"},
		{"Error: ", "panicked: oops"},
	}
	for i, w := range wants {
		m := items[2+i]
		content, _ := m["content"].(string)
		if m["role"] != "tool" || m["tool_call_id"] != "call-"+string(rune('0'+i)) || !strings.HasPrefix(content, w.prefix) || !strings.Contains(content, w.contains) {
			t.Errorf("tool message %d = %v, want content starting %q containing %q for call-%d", i, m, w.prefix, w.contains, i)
		}
	}
	// The tools were offered on both calls, and the second call carried
	// the tool messages.
	bodies := up.requestBodies()
	if len(bodies) != 2 {
		t.Fatalf("upstream got %d requests, want 2", len(bodies))
	}
	for i, b := range bodies {
		if offered, _ := b["tools"].([]any); len(offered) != 3 {
			t.Errorf("request %d offered %d tools, want 3", i, len(offered))
		}
	}
	if msgs, _ := bodies[1]["messages"].([]any); len(msgs) != 8 {
		t.Errorf("second request sent %d messages, want 8", len(msgs))
	}
}

// The turn budget counts model calls; running out of it with tool calls
// pending returns the last completion, not an error.
func TestRunTurnBudget(t *testing.T) {
	for _, tc := range []struct {
		maxTurns, wantCalls int
	}{{1, 1}, {3, 3}, {0, osmoopenai.DefaultMaxTurns}, {-1, osmoopenai.DefaultMaxTurns}} {
		up := newScripted(t, toolCallsReply(t, [2]string{"multiply", `{"a":1,"b":2}`}))
		ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
		s, err := osmoopenai.NewSession(ctx, "s")
		if err != nil {
			t.Fatal(err)
		}
		s.AddItems(openai.UserMessage("loop forever"))
		resp, err := osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{}, []osmoopenai.Tool{multiplyTool()}, tc.maxTurns)
		if err != nil {
			t.Fatalf("maxTurns %d: %v", tc.maxTurns, err)
		}
		if n := len(up.requestBodies()); n != tc.wantCalls {
			t.Errorf("maxTurns %d: %d model calls, want %d", tc.maxTurns, n, tc.wantCalls)
		}
		if len(resp.Choices[0].Message.ToolCalls) != 1 {
			t.Errorf("maxTurns %d: last completion has no pending tool call", tc.maxTurns)
		}
		// user + per turn an assistant message, + a tool message for all
		// turns but the last.
		if got, want := len(s.Items()), 1+tc.wantCalls+(tc.wantCalls-1); got != want {
			t.Errorf("maxTurns %d: %d items, want %d", tc.maxTurns, got, want)
		}
	}
}

// RunText sends what Run sends, leaves the session as Run leaves it and
// returns the text Run's last completion holds: for a final answer, for
// one only openai-go reads (content in parts), for a message without
// text, and when the turn budget runs out with tool calls pending.
func TestRunTextIsRun(t *testing.T) {
	calls := toolCallsReply(t, [2]string{"multiply", `{"a":6,"b":7}`})
	for _, tc := range []struct {
		name     string
		replies  []string
		maxTurns int
		want     string
	}{
		{"answer", []string{calls, completion(`{"role":"assistant","content":"6 times 7 is 42"}`)}, 5, "6 times 7 is 42"},
		// openai-go keeps content of another type as its JSON.
		{"parts", []string{calls, completion(`{"role":"assistant","content":[{"type":"text","text":"42"}]}`)}, 5, `[{"type":"text","text":"42"}]`},
		{"refusal", []string{completion(`{"role":"assistant","content":null,"refusal":"no"}`)}, 5, ""},
		{"budget", []string{calls}, 2, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			type result struct {
				text   string
				items  []osmo.Message
				bodies []map[string]any
			}
			runs := map[string]func(ctx context.Context, s *osmoopenai.Session) (string, error){
				"Run": func(ctx context.Context, s *osmoopenai.Session) (string, error) {
					resp, err := osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(task)}}, []osmoopenai.Tool{multiplyTool()}, tc.maxTurns)
					if err != nil {
						return "", err
					}
					return resp.Choices[0].Message.Content, nil
				},
				"RunText": func(ctx context.Context, s *osmoopenai.Session) (string, error) {
					return osmoopenai.RunText(ctx, s, openai.ChatCompletionNewParams{Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(task)}}, []osmoopenai.Tool{multiplyTool()}, tc.maxTurns)
				},
			}
			got := map[string]result{}
			for name, run := range runs {
				up := newScripted(t, tc.replies...)
				ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
				s, err := osmoopenai.NewSession(ctx, "s")
				if err != nil {
					t.Fatal(err)
				}
				text, err := run(ctx, s)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				got[name] = result{text, s.Items(), up.requestBodies()}
			}
			run, text := got["Run"], got["RunText"]
			if run.text != tc.want || text.text != tc.want {
				t.Errorf("text: Run's %q, RunText's %q, want %q", run.text, text.text, tc.want)
			}
			if !reflect.DeepEqual(run.items, text.items) {
				t.Errorf("session items differ:\n Run     %v\n RunText %v", run.items, text.items)
			}
			if !reflect.DeepEqual(run.bodies, text.bodies) {
				t.Errorf("requests differ:\n Run     %v\n RunText %v", run.bodies, text.bodies)
			}
		})
	}
}

func TestRunRejectsBadTools(t *testing.T) {
	ok := func(context.Context, json.RawMessage) (string, error) { return "", nil }
	tests := []struct {
		name  string
		tools []osmoopenai.Tool
		want  string
	}{
		{"nil call", []osmoopenai.Tool{{Name: "t"}}, `tools[0] "t": Call is nil`},
		{"bad name", []osmoopenai.Tool{{Name: "no spaces", Call: ok}}, "tools[0]: tool name"},
		{"duplicate", []osmoopenai.Tool{{Name: "t", Call: ok}, {Name: "t", Call: ok}}, `tools[1]: tool "t" is declared twice`},
		{"bad schema", []osmoopenai.Tool{{Name: "t", Call: ok, Parameters: map[string]any{"type": "array"}}}, "parameters.type"},
		{"required not a property", []osmoopenai.Tool{{Name: "t", Call: ok, Parameters: map[string]any{"type": "object", "required": []any{"x"}}}}, `required parameter "x"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := newScripted(t, completion(`{"role":"assistant","content":"x"}`))
			ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
			s, err := osmoopenai.NewSession(ctx, "s")
			if err != nil {
				t.Fatal(err)
			}
			s.AddItems(openai.UserMessage("hi"))
			_, err = osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{}, tc.tools, 0)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one containing %q", err, tc.want)
			}
			if n := len(up.requestBodies()); n != 0 {
				t.Errorf("upstream got %d requests, want none", n)
			}
		})
	}
}

func TestRunNilSession(t *testing.T) {
	if _, err := osmoopenai.Run(testCtx(t), nil, openai.ChatCompletionNewParams{}, nil, 0); err == nil {
		t.Fatal("Run with a nil session: no error")
	}
}

// A failed model call fails the run and names the turn.
func TestRunModelFailure(t *testing.T) {
	up := newScripted(t, `not json`)
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	s.AddItems(openai.UserMessage("hi"))
	if _, err := osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{}, nil, 0); err == nil || !strings.Contains(err.Error(), "turn 1") {
		t.Fatalf("err = %v, want one naming turn 1", err)
	}
}

func TestToolSchema(t *testing.T) {
	got := multiplyTool().Schema()
	fn, _ := got["function"].(map[string]any)
	if got["type"] != "function" || fn["name"] != "multiply" || fn["description"] != "Multiply two numbers." || fn["parameters"] == nil {
		t.Errorf("Schema() = %v", got)
	}
	bare := osmoopenai.Tool{Name: "bare"}.Schema()
	if fn, _ := bare["function"].(map[string]any); len(fn) != 1 {
		t.Errorf("schema of a tool with only a name = %v, want only the name", bare)
	}
}

// A cancelled rollout ends a run waiting on the model.
func TestRunEndsWithItsContext(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return srv.URL + "/v1" })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	s.AddItems(openai.UserMessage("hi"))
	ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{}, nil, 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want context.DeadlineExceeded", err)
	}
}
