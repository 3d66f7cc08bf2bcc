package osmo

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
)

// ToolArgumentError reports a tool call whose arguments are not a JSON object.
type ToolArgumentError struct {
	ToolCallID string
	ToolName   string
	Err        error
}

func (e *ToolArgumentError) Error() string {
	return fmt.Sprintf("invalid arguments for tool %q (call %s): %v", e.ToolName, e.ToolCallID, e.Err)
}

func (e *ToolArgumentError) Unwrap() error { return e.Err }

// GetToolCallInfo returns a tool call's id, function name and parsed
// arguments. Empty arguments parse as an empty object; anything that is not a
// JSON object is a *ToolArgumentError naming the call and the tool.
func GetToolCallInfo(tc ToolCall) (id, name string, args map[string]any, err error) {
	id, name = tc.ID, tc.Function.Name
	if tc.Function.Arguments == "" {
		return id, name, map[string]any{}, nil
	}
	if err := json.Unmarshal([]byte(tc.Function.Arguments), &args); err != nil {
		return id, name, nil, &ToolArgumentError{ToolCallID: id, ToolName: name, Err: err}
	}
	if args == nil {
		return id, name, nil, &ToolArgumentError{ToolCallID: id, ToolName: name, Err: fmt.Errorf("arguments must be a JSON object, got null")}
	}
	return id, name, args, nil
}

// ToolResult is the tool message answering a call:
// {"role":"tool","content":content,"tool_call_id":id}.
func ToolResult(toolCallID, content string) Message {
	return Message{"role": "tool", "content": content, "tool_call_id": toolCallID}
}

// ToolErrorResult is ToolResult with content "Error: <message>".
func ToolErrorResult(toolCallID, message string) Message {
	return ToolResult(toolCallID, toolErrorPrefix+message)
}

// toolErrorPrefix starts the content of a ToolErrorResult.
const toolErrorPrefix = "Error: "

// SerializeToolResult renders a tool's return value as message content:
// strings unchanged, booleans as JSON (true/false), numbers as decimal text,
// anything else as JSON.
func SerializeToolResult(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case bool:
		return strconv.FormatBool(x)
	case int:
		return strconv.Itoa(x)
	case int8, int16, int32, int64, uint, uint8, uint16, uint32, uint64:
		return fmt.Sprintf("%d", x)
	case float32:
		return strconv.FormatFloat(float64(x), 'f', -1, 32)
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	case json.Number:
		return x.String()
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// ToolExecutor runs one tool call and returns its tool message.
type ToolExecutor func(ctx context.Context, tc ToolCall) Message

// tracerName names the tracer of the SDK's spans.
const tracerName = "github.com/osmo-rl/osmo"

// ExecuteToolCalls runs every call concurrently and returns their messages in
// the order of calls. A panicking executor becomes a ToolErrorResult for its
// call rather than taking the rollout down.
//
// When ctx carries a recording span (the rollout service's, when tracing is
// on), each call is a span "execute_tool {name}" (OpenTelemetry GenAI
// conventions) under it, and exec gets that span's context. A result that
// is a ToolErrorResult marks the span failed (error.type tool_error, or
// panic).
func ExecuteToolCalls(ctx context.Context, calls []ToolCall, exec ToolExecutor) []Message {
	out := make([]Message, len(calls))
	// The provider of the caller's span: no global tracer provider.
	tracer := trace.SpanFromContext(ctx).TracerProvider().Tracer(tracerName)
	var wg sync.WaitGroup
	for i, tc := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, span := tracer.Start(ctx, "execute_tool "+tc.Function.Name, trace.WithAttributes(
				semconv.GenAIOperationNameExecuteTool,
				semconv.GenAIToolName(tc.Function.Name),
				semconv.GenAIToolCallID(tc.ID),
				semconv.GenAIToolType("function"),
			))
			defer span.End()
			defer func() {
				if r := recover(); r != nil {
					out[i] = ToolErrorResult(tc.ID, fmt.Sprintf("tool %q panicked: %v", tc.Function.Name, r))
					span.SetAttributes(semconv.ErrorTypeKey.String("panic"))
					span.SetStatus(codes.Error, fmt.Sprint(r))
				}
			}()
			out[i] = exec(ctx, tc)
			if content, _ := out[i]["content"].(string); strings.HasPrefix(content, toolErrorPrefix) && span.IsRecording() {
				span.SetAttributes(semconv.ErrorTypeKey.String("tool_error"))
				span.SetStatus(codes.Error, strings.TrimPrefix(content, toolErrorPrefix))
			}
		}()
	}
	wg.Wait()
	return out
}
