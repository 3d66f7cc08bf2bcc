package osmo_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
)

func TestExecuteToolCallsSpans(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, parent := tp.Tracer("test").Start(context.Background(), "agent")

	calls := []osmo.ToolCall{
		{ID: "c1", Type: "function", Function: osmo.FunctionCall{Name: "add", Arguments: `{"a":1}`}},
		{ID: "c2", Type: "function", Function: osmo.FunctionCall{Name: "fail"}},
		{ID: "c3", Type: "function", Function: osmo.FunctionCall{Name: "explode"}},
	}
	var inTool trace.SpanContext
	out := osmo.ExecuteToolCalls(ctx, calls, func(ctx context.Context, tc osmo.ToolCall) osmo.Message {
		switch tc.Function.Name {
		case "fail":
			return osmo.ToolErrorResult(tc.ID, "no such thing")
		case "explode":
			panic("kaboom")
		}
		inTool = trace.SpanContextFromContext(ctx)
		return osmo.ToolResult(tc.ID, "2")
	})
	parent.End()
	if out[0]["content"] != "2" || out[2]["content"] != `Error: tool "explode" panicked: kaboom` {
		t.Fatalf("results %v", out)
	}

	spans := map[string]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		spans[s.Name] = s
	}
	for _, tc := range []struct {
		name, id, errType string
	}{
		{"add", "c1", ""},
		{"fail", "c2", "tool_error"},
		{"explode", "c3", "panic"},
	} {
		s, ok := spans["execute_tool "+tc.name]
		if !ok {
			t.Errorf("no span for tool %s", tc.name)
			continue
		}
		got := map[attribute.Key]string{}
		for _, kv := range s.Attributes {
			got[kv.Key] = kv.Value.String()
		}
		if s.Parent.SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("%s: parent %v, want the caller's span", tc.name, s.Parent.SpanID())
		}
		if got["gen_ai.operation.name"] != "execute_tool" || got["gen_ai.tool.name"] != tc.name || got["gen_ai.tool.call.id"] != tc.id {
			t.Errorf("%s: attributes %v", tc.name, got)
		}
		if failed := s.Status.Code == codes.Error; failed != (tc.errType != "") || got["error.type"] != tc.errType {
			t.Errorf("%s: status %v error.type %q, want %q", tc.name, s.Status, got["error.type"], tc.errType)
		}
	}
	if inTool.SpanID() != spans["execute_tool add"].SpanContext.SpanID() {
		t.Error("the executor did not get its tool span's context")
	}

	// Without a span in the context nothing is recorded and nothing changes.
	exp.Reset()
	out = osmo.ExecuteToolCalls(context.Background(), calls[:1], func(_ context.Context, tc osmo.ToolCall) osmo.Message {
		return osmo.ToolResult(tc.ID, "2")
	})
	if out[0]["content"] != "2" || len(exp.GetSpans()) != 0 {
		t.Errorf("untraced: results %v, %d spans", out, len(exp.GetSpans()))
	}
}
