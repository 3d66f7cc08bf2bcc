package osmoopenai

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/openai/openai-go/v3"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// DefaultMaxTurns is Run's budget of model calls when it is given none.
const DefaultMaxTurns = 10

// Tool is a function tool: the schema offered to the model and the Go code
// that runs a call.
type Tool struct {
	// Name is the function name (1-64 letters, digits, _ or -).
	Name        string
	Description string
	// Parameters is the JSON Schema of the arguments object; nil offers a
	// function without parameters.
	Parameters map[string]any
	// Call runs one call. args is the JSON object the model sent ("{}" when
	// it sent none). The string returned is the tool message's content; an
	// error is reported to the model as "Error: <message>" so it can recover.
	// Calls of one turn run concurrently.
	Call func(ctx context.Context, args json.RawMessage) (string, error)
}

// Schema is the tool as an OpenAI function tool schema, the form
// osmo.ToolProvider and osmo.ValidateTool use.
func (t Tool) Schema() osmo.Tool {
	fn := map[string]any{"name": t.Name}
	if t.Description != "" {
		fn["description"] = t.Description
	}
	if t.Parameters != nil {
		fn["parameters"] = t.Parameters
	}
	return osmo.Tool{"type": "function", "function": fn}
}

// param is the tool as a request param.
func (t Tool) param() openai.ChatCompletionToolUnionParam {
	def := openai.FunctionDefinitionParam{Name: t.Name, Parameters: t.Parameters}
	if t.Description != "" {
		def.Description = openai.String(t.Description)
	}
	return openai.ChatCompletionFunctionTool(def)
}

// Run is a minimal agent loop over s, what Runner.run does for a single
// agent: it calls Complete (params.Messages, if any, are added to the
// session first; tools are offered after any params.Tools), and while the
// reply asks for tools and fewer than maxTurns model calls were made, runs
// every call, appends the tool messages and calls the model again. It
// returns the last completion. maxTurns <= 0 means DefaultMaxTurns.
//
// Whatever goes wrong in a tool call (an unknown tool, arguments that are
// not a JSON object, an error or panic in Call) becomes a tool message
// "Error: ..." for the model to read, never a failed run. When the budget
// runs out with tool calls pending, the last completion is returned as is
// (its tool calls unanswered): reaching the budget is an outcome to grade,
// not an error. Errors are for tools that cannot be offered and for failed
// model calls.
func Run(ctx context.Context, s *Session, params openai.ChatCompletionNewParams, tools []Tool, maxTurns int) (*openai.ChatCompletion, error) {
	return run(ctx, "osmoopenai.Run", s, &params, tools, maxTurns)
}

// RunText is Run for a caller that reads no more of the last reply than
// its text: it returns the content of the last reply's message ("" when it
// has none, as when the budget runs out with tool calls pending). The
// conversation is in the session as after Run (Session.Items).
func RunText(ctx context.Context, s *Session, params openai.ChatCompletionNewParams, tools []Tool, maxTurns int) (string, error) {
	resp, err := run(ctx, "osmoopenai.RunText", s, &params, tools, maxTurns)
	if err != nil {
		return "", err
	}
	return resp.Choices[0].Message.Content, nil
}

// run is Run, named name in its errors, on params, which it changes.
func run(ctx context.Context, name string, s *Session, params *openai.ChatCompletionNewParams, tools []Tool, maxTurns int) (*openai.ChatCompletion, error) {
	if s == nil {
		return nil, fmt.Errorf("%s: nil session", name)
	}
	if maxTurns <= 0 {
		maxTurns = DefaultMaxTurns
	}
	exec, err := offer(params, tools)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	// Everything the loop does is the session's sample: its spans (tool
	// calls included) carry osmo.sample.id when tracing.
	ctx = osmoattr.ContextWithIDs(ctx, s.rollout.ID, s.id)
	for turn := 1; ; turn++ {
		resp, err := s.complete(ctx, params)
		if err != nil {
			return nil, fmt.Errorf("%s: turn %d: %w", name, turn, err)
		}
		// The caller's messages are in the session now.
		params.Messages = nil
		calls := resp.Choices[0].Message.ToolCalls
		if len(calls) == 0 {
			return resp, nil
		}
		if turn >= maxTurns {
			s.log.DebugContext(ctx, "osmoopenai: turn budget reached with tool calls pending", "max_turns", maxTurns, "tool_calls", len(calls))
			return resp, nil
		}
		s.runTools(ctx, calls, exec, turn)
	}
}

// offer checks tools and adds them to params.Tools, after any there, and
// returns their executor.
func offer(params *openai.ChatCompletionNewParams, tools []Tool) (osmo.ToolExecutor, error) {
	byName := make(map[string]Tool, len(tools))
	offered := slices.Clip(params.Tools)
	for i, t := range tools {
		if _, err := osmo.ValidateTool(t.Schema()); err != nil {
			return nil, fmt.Errorf("tools[%d]: %w", i, err)
		}
		if t.Call == nil {
			return nil, fmt.Errorf("tools[%d] %q: Call is nil", i, t.Name)
		}
		if _, dup := byName[t.Name]; dup {
			return nil, fmt.Errorf("tools[%d]: tool %q is declared twice", i, t.Name)
		}
		byName[t.Name] = t
		offered = append(offered, t.param())
	}
	params.Tools = offered
	if params.Model == "" {
		params.Model = Model
	}
	return executor(byName), nil
}

// runTools runs a reply's tool calls and appends their tool messages.
func (s *Session) runTools(ctx context.Context, calls []openai.ChatCompletionMessageToolCallUnion, exec osmo.ToolExecutor, turn int) {
	results := osmo.ExecuteToolCalls(ctx, toolCalls(calls), exec)
	msgs := make([]openai.ChatCompletionMessageParamUnion, len(results))
	failed := 0
	for i, r := range results {
		content, _ := r["content"].(string)
		id, _ := r["tool_call_id"].(string)
		if strings.HasPrefix(content, "Error: ") {
			failed++
		}
		msgs[i] = openai.ToolMessage(content, id)
	}
	s.AddItems(msgs...)
	s.log.DebugContext(ctx, "osmoopenai: tools executed", "turn", turn, "tool_calls", len(calls), "failed", failed)
	s.rollout.LogEvent("osmoopenai_tools", map[string]any{"sample_id": s.id, "turn": turn, "tool_calls": len(calls), "failed": failed})
}

// toolCalls converts the reply's tool calls for osmo.ExecuteToolCalls.
func toolCalls(calls []openai.ChatCompletionMessageToolCallUnion) []osmo.ToolCall {
	out := make([]osmo.ToolCall, len(calls))
	for i, c := range calls {
		tc := osmo.ToolCall{ID: c.ID, Type: c.Type, Function: osmo.FunctionCall{Name: c.Function.Name, Arguments: c.Function.Arguments}}
		if c.Type == "custom" {
			tc.Function = osmo.FunctionCall{Name: c.Custom.Name, Arguments: c.Custom.Input}
		}
		out[i] = tc
	}
	return out
}

// executor runs one call against the declared tools, turning every failure
// into an error message for the model.
func executor(tools map[string]Tool) osmo.ToolExecutor {
	names := slices.Sorted(maps.Keys(tools))
	return func(ctx context.Context, tc osmo.ToolCall) osmo.Message {
		if tc.Type != "" && tc.Type != "function" {
			return osmo.ToolErrorResult(tc.ID, fmt.Sprintf("tool call type %q is not supported: call one of the functions offered (%s)", tc.Type, strings.Join(names, ", ")))
		}
		t, ok := tools[tc.Function.Name]
		if !ok {
			return osmo.ToolErrorResult(tc.ID, fmt.Sprintf("unknown tool %q: call one of the functions offered (%s)", tc.Function.Name, strings.Join(names, ", ")))
		}
		args := json.RawMessage(tc.Function.Arguments)
		if !isObject(args) {
			// GetToolCallInfo says what is wrong with them, as any
			// executor would.
			if _, _, _, err := osmo.GetToolCallInfo(tc); err != nil {
				return osmo.ToolErrorResult(tc.ID, err.Error())
			}
		}
		if len(args) == 0 {
			args = json.RawMessage(`{}`)
		}
		out, err := t.Call(ctx, args)
		if err != nil {
			return osmo.ToolErrorResult(tc.ID, fmt.Sprintf("tool %q: %v", t.Name, err))
		}
		return osmo.ToolResult(tc.ID, out)
	}
}

// isObject reports whether args are a JSON object, without decoding them:
// the arguments GetToolCallInfo accepts but for none at all.
func isObject(args []byte) bool {
	i := 0
	for i < len(args) && (args[i] == ' ' || args[i] == '\t' || args[i] == '\n' || args[i] == '\r') {
		i++
	}
	return i < len(args) && args[i] == '{' && json.Valid(args)
}
