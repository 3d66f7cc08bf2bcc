package main

import (
	"context"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
)

// policy plays the model: first it asks for the tool, then it answers with
// what the tool said.
type policy struct{ turn int }

func (p *policy) Chat(_ context.Context, msgs []osmo.Message, _ map[string]any) (*osmo.ChatResult, error) {
	p.turn++
	if p.turn == 1 {
		return &osmo.ChatResult{
			Message:   osmo.Message{"role": "assistant", "tool_calls": []any{}},
			ToolCalls: []osmo.ToolCall{{ID: "c1", Type: "function", Function: osmo.FunctionCall{Name: "count_words", Arguments: `{"text":"the quick brown fox"}`}}},
		}, nil
	}
	last := msgs[len(msgs)-1]
	return &osmo.ChatResult{Message: osmo.Message{"role": "assistant", "content": "There are " + last["content"].(string) + " words."}, FinishReason: "stop"}, nil
}
func (*policy) RecordToolCall(time.Duration)    {}
func (*policy) LogEvent(string, map[string]any) {}

func TestWordCountLoopAndReward(t *testing.T) {
	req := &osmo.RolloutRequest{MaxTurns: 5, Messages: []osmo.Message{{"role": "user", "content": "How many words in 'the quick brown fox'?"}}}
	res, err := WordCount{}.Run(context.Background(), osmo.NewRolloutContext(req, nil, &policy{}))
	if err != nil {
		t.Fatal(err)
	}
	answer := osmo.LastAssistantText(res.FinalMessages)
	if answer != "There are 4 words." {
		t.Fatalf("answer %q", answer)
	}
	for truth, want := range map[string]float64{"4": 1, "5": 0} {
		if r, err := ExactNumber(answer, truth, nil); err != nil || r != want {
			t.Errorf("ExactNumber(%q, %q) = %v, %v; want %v", answer, truth, r, err, want)
		}
	}
	if _, err := ExactNumber(answer, "four", nil); err == nil {
		t.Error("a non-numeric ground truth must be an error")
	}
}
