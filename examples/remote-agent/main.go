// Command remote-agent is a rollout server with your own agent loop and
// reward, built with osmo as a library. It serves everything `osmo` does
// (serve, rollout, grader, gateway, ...) with one more workflow, "wordcount",
// graded by a custom reward function:
//
//	go run ./examples/remote-agent serve --workflow wordcount -p 9000
package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/cli"
)

func main() {
	cli.Main(
		cli.WithAgentLoop(WordCount{}, "wordcount-exact"),
		cli.WithGrader("wordcount-exact", osmo.RewardGrader(ExactNumber)),
	)
}

// WordCount answers "how many words are in ...?" with a count_words tool.
type WordCount struct{}

// Name implements osmo.RolloutAgentLoop.
func (WordCount) Name() string { return "wordcount" }

// GetTools implements osmo.RolloutAgentLoop.
func (WordCount) GetTools(*osmo.RolloutRequest) ([]osmo.Tool, error) {
	return []osmo.Tool{{
		"type": "function",
		"function": map[string]any{
			"name":        "count_words",
			"description": "Count the words in a text",
			"parameters": map[string]any{
				"type":       "object",
				"properties": map[string]any{"text": map[string]any{"type": "string"}},
				"required":   []any{"text"},
			},
		},
	}}, nil
}

// Run implements osmo.RolloutAgentLoop.
func (WordCount) Run(ctx context.Context, rc *osmo.RolloutContext) (*osmo.RolloutResult, error) {
	messages := osmo.CloneMessages(rc.Request.Messages)
	for turn := 0; turn < rc.Request.MaxTurns; turn++ {
		res, err := rc.Chat(ctx, messages, nil)
		if err != nil {
			return nil, err
		}
		messages = append(messages, res.Message)
		if !res.HasToolCalls() {
			return rc.Complete(messages, res.FinishReason, nil), nil
		}
		start := time.Now()
		messages = append(messages, osmo.ExecuteToolCalls(ctx, res.ToolCalls, countWords)...)
		rc.RecordToolCall(time.Since(start))
	}
	return rc.Complete(messages, "max_turns", nil), nil
}

func countWords(_ context.Context, tc osmo.ToolCall) osmo.Message {
	id, name, args, err := osmo.GetToolCallInfo(tc)
	if err != nil {
		return osmo.ToolErrorResult(id, err.Error())
	}
	if name != "count_words" {
		return osmo.ToolErrorResult(id, "Unknown tool: "+name)
	}
	text, ok := args["text"].(string)
	if !ok {
		return osmo.ToolErrorResult(id, "text must be a string")
	}
	return osmo.ToolResult(id, osmo.SerializeToolResult(len(strings.Fields(text))))
}

// ExactNumber is a reward function in the shape of @osmosis_reward: 1.0 when
// the last number in the answer equals the ground truth.
func ExactNumber(solution, groundTruth string, _ map[string]any) (float64, error) {
	want, err := strconv.ParseFloat(strings.TrimSpace(groundTruth), 64)
	if err != nil {
		return 0, fmt.Errorf("ground truth %q is not a number", groundTruth)
	}
	fields := strings.FieldsFunc(solution, func(r rune) bool { return !(r >= '0' && r <= '9' || r == '.' || r == '-') })
	for i := len(fields) - 1; i >= 0; i-- {
		if got, err := strconv.ParseFloat(strings.Trim(fields[i], "."), 64); err == nil {
			if got == want {
				return 1, nil
			}
			return 0, nil
		}
	}
	return 0, nil
}
