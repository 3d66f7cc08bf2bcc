package osmo_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

func TestGetToolCallInfo(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    string
		want    map[string]any
		wantErr bool
	}{
		{"object", `{"a": 1, "b": "x"}`, map[string]any{"a": 1.0, "b": "x"}, false},
		{"empty means no arguments", ``, map[string]any{}, false},
		{"not JSON", `{a:1}`, nil, true},
		{"array", `[1,2]`, nil, true},
		{"null", `null`, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, name, args, err := osmo.GetToolCallInfo(osmo.ToolCall{ID: "call_1", Type: "function", Function: osmo.FunctionCall{Name: "add", Arguments: tc.args}})
			if id != "call_1" || name != "add" {
				t.Fatalf("id/name = %q/%q", id, name)
			}
			if tc.wantErr {
				var te *osmo.ToolArgumentError
				if !errors.As(err, &te) || te.ToolCallID != "call_1" || te.ToolName != "add" {
					t.Fatalf("err = %v, want *ToolArgumentError naming call_1 and add", err)
				}
				return
			}
			if err != nil || fmt.Sprint(args) != fmt.Sprint(tc.want) {
				t.Fatalf("args = %v, err = %v", args, err)
			}
		})
	}
}

func TestSerializeToolResult(t *testing.T) {
	for _, tc := range []struct {
		in   any
		want string
	}{
		{"plain text", "plain text"},
		{true, "true"},
		{false, "false"},
		{42, "42"},
		{int64(-7), "-7"},
		{2.5, "2.5"},
		{1e21, "1000000000000000000000"},
		{map[string]any{"k": []int{1, 2}}, `{"k":[1,2]}`},
		{[]string{"a"}, `["a"]`},
		{nil, "null"},
	} {
		if got := osmo.SerializeToolResult(tc.in); got != tc.want {
			t.Errorf("SerializeToolResult(%#v) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestToolResults(t *testing.T) {
	r := osmo.ToolResult("c1", "42")
	if r["role"] != "tool" || r["content"] != "42" || r["tool_call_id"] != "c1" {
		t.Fatalf("ToolResult = %v", r)
	}
	e := osmo.ToolErrorResult("c2", "division by zero")
	if e["content"] != "Error: division by zero" || e["tool_call_id"] != "c2" {
		t.Fatalf("ToolErrorResult = %v", e)
	}
}

// TestExecuteToolCallsIsConcurrentAndOrdered: every call runs at once (the
// bubble's goroutines all block in their tools before any is released),
// the results keep the calls' order, and a panicking tool becomes an
// error result.
func TestExecuteToolCallsIsConcurrentAndOrdered(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		calls := make([]osmo.ToolCall, 8)
		for i := range calls {
			calls[i] = osmo.ToolCall{ID: fmt.Sprint(i), Function: osmo.FunctionCall{Name: "sleep"}}
		}
		var inFlight atomic.Int32
		release := make(chan struct{})
		results := make(chan []osmo.Message, 1)
		go func() {
			results <- osmo.ExecuteToolCalls(context.Background(), calls, func(_ context.Context, tc osmo.ToolCall) osmo.Message {
				inFlight.Add(1)
				<-release
				if tc.ID == "3" {
					panic("boom")
				}
				return osmo.ToolResult(tc.ID, "ok "+tc.ID)
			})
		}()
		synctest.Wait()
		if n := inFlight.Load(); n != int32(len(calls)) {
			t.Fatalf("%d of %d tool calls running at once", n, len(calls))
		}
		close(release)
		out := <-results
		for i, m := range out {
			if m["tool_call_id"] != fmt.Sprint(i) {
				t.Fatalf("result %d is for call %v: order not kept", i, m["tool_call_id"])
			}
		}
		if out[3]["content"] != `Error: tool "sleep" panicked: boom` {
			t.Fatalf("panicking tool = %v", out[3])
		}
	})
}

func TestGraderContext(t *testing.T) {
	gc := osmotest.NewGraderContext("r1", []*osmo.Sample{{ID: "a"}, {ID: "b"}}, nil, nil)
	if err := gc.SetSampleReward("a", math.NaN()); !errors.Is(err, osmo.ErrNonFiniteReward) {
		t.Fatalf("NaN: %v", err)
	}
	if err := gc.SetSampleReward("a", math.Inf(1)); !errors.Is(err, osmo.ErrNonFiniteReward) {
		t.Fatalf("Inf: %v", err)
	}
	if err := gc.SetSampleReward("zzz", 1); err == nil {
		t.Fatal("unknown sample accepted")
	}
	if got := gc.Ungraded(); fmt.Sprint(got) != "[a b]" {
		t.Fatalf("Ungraded = %v", got)
	}
	if err := gc.SetSampleReward("a", 0.25); err != nil {
		t.Fatal(err)
	}
	if err := gc.RemoveSample("b"); err != nil {
		t.Fatal(err)
	}
	if r, ok := gc.Reward("a"); !ok || r != 0.25 || !gc.Removed("b") || len(gc.Ungraded()) != 0 {
		t.Fatalf("state: %v %v %v %v", r, ok, gc.Removed("b"), gc.Ungraded())
	}
}

func TestLastAssistantText(t *testing.T) {
	for _, tc := range []struct {
		name string
		msgs []osmo.Message
		want string
	}{
		{"openai chat", []osmo.Message{{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}, {"role": "assistant", "content": "42"}}, "42"},
		{"tool call message is skipped", []osmo.Message{{"role": "assistant", "content": "done"}, {"role": "assistant", "content": nil, "tool_calls": []any{}}}, "done"},
		{"strands blocks", []osmo.Message{{"role": "assistant", "content": []any{map[string]any{"toolUse": map[string]any{}}, map[string]any{"text": "7"}}}}, "7"},
		{"openai agents items", []osmo.Message{{"type": "message", "role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "six"}}}}, "six"},
		{"none", []osmo.Message{{"role": "user", "content": "q"}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := osmo.LastAssistantText(tc.msgs); got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestRewardGrader(t *testing.T) {
	g := osmo.RewardGrader(func(solution, truth string, _ map[string]any) (float64, error) {
		if solution == truth {
			return 1, nil
		}
		return 0, nil
	})
	label := "42"
	gc := osmotest.NewGraderContext("r", []*osmo.Sample{
		{ID: "right", Messages: []osmo.Message{{"role": "assistant", "content": "42"}}},
		{ID: "wrong", Messages: []osmo.Message{{"role": "assistant", "content": "41"}}},
	}, &label, nil)
	if err := g.Grade(context.Background(), gc); err != nil {
		t.Fatal(err)
	}
	if r, _ := gc.Reward("right"); r != 1 {
		t.Fatalf("right = %v", r)
	}
	if r, _ := gc.Reward("wrong"); r != 0 {
		t.Fatalf("wrong = %v", r)
	}
	if err := g.Grade(context.Background(), osmotest.NewGraderContext("r", []*osmo.Sample{{ID: "x"}}, nil, nil)); err == nil {
		t.Fatal("grading without a label must fail")
	}
}
