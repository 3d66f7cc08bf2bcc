package graders_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/osmotest"
)

// chat is an OpenAI chat conversation as the multiply workflow's session
// records it: a tool call (content null), its result, then final.
func chat(final any) []osmo.Message {
	return []osmo.Message{
		{"role": "system", "content": "Use the multiply tool when arithmetic is required."},
		{"role": "user", "content": "What is 6 times 7?"},
		{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
			"id": "c1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":6,"b":7}`},
		}}},
		{"role": "tool", "content": "42", "tool_call_id": "c1"},
		{"role": "assistant", "content": final},
	}
}

func TestMultiplyGrader(t *testing.T) {
	label := func(s string) *string { return &s }
	tests := []struct {
		name     string
		label    *string
		messages []osmo.Message
		want     float64
	}{
		{"label in answer", label("42"), chat("The answer is 42.\n#### 42"), 1},
		{"label trimmed", label("  42\n"), chat("6 times 7 is 42"), 1},
		{"answer in content parts", label("42"), chat([]any{map[string]any{"type": "text", "text": "It is 42."}}), 1},
		{"label not in answer", label("42"), chat("The answer is 41."), 0},
		{"only the tool result holds the label", label("42"), chat("I could not work it out."), 0},
		{"nil label", nil, chat("42"), 0},
		{"blank label", label("  "), chat("42"), 0},
		{"no assistant message", label("42"), []osmo.Message{{"role": "user", "content": "42"}}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gc := osmotest.NewGraderContext("r", []*osmo.Sample{{ID: "multiply-agent", Messages: tc.messages}}, tc.label, nil)
			if err := (graders.MultiplyGrader{}).Grade(testContext(t), gc); err != nil {
				t.Fatal(err)
			}
			got, ok := gc.Reward("multiply-agent")
			if !ok || got != tc.want {
				t.Errorf("reward = %v (set %v), want %v", got, ok, tc.want)
			}
		})
	}
}

// Every sample gets its own reward, by the registered name too.
func TestMultiplyGraderRewardsEverySample(t *testing.T) {
	if !slices.Contains(graders.Names(), "multiply") {
		t.Fatalf("Names() = %v, want multiply among them", graders.Names())
	}
	g, err := graders.Lookup("multiply")
	if err != nil {
		t.Fatal(err)
	}
	label := "42"
	gc := osmotest.NewGraderContext("r", []*osmo.Sample{
		{ID: "a", Messages: chat("42")},
		{ID: "b", Messages: chat("41")},
		{ID: "c", Messages: chat("so 42 it is")},
		{ID: "d"},
	}, &label, nil)
	if err := g.Grade(testContext(t), gc); err != nil {
		t.Fatal(err)
	}
	if left := gc.Ungraded(); len(left) != 0 {
		t.Fatalf("ungraded: %v", left)
	}
	for id, want := range map[string]float64{"a": 1, "b": 0, "c": 1, "d": 0} {
		if got, _ := gc.Reward(id); got != want {
			t.Errorf("%s: reward %v, want %v", id, got, want)
		}
	}
	if _, err := graders.Lookup("multiply:x=1"); !errors.Is(err, graders.ErrInvalidSpec) {
		t.Errorf("Lookup with a parameter: err = %v, want ErrInvalidSpec", err)
	}
}

func TestMultiplyGraderStopsOnCancelledContext(t *testing.T) {
	label := "42"
	gc := osmotest.NewGraderContext("r", []*osmo.Sample{{ID: "a", Messages: chat("42")}}, &label, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := (graders.MultiplyGrader{}).Grade(ctx, gc); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}
