// Package calculator is the built-in "calculator" workflow: the add/multiply
// agent of the Osmosis remote-rollout guide, as an osmo.RolloutAgentLoop.
//
// Its reward (1.0 when the last assistant message contains the row's
// metadata.ground_truth, also after "####"; none without a ground truth) is
// set by the "calculator" grader of the grader service, not by the loop, so
// the same rule grades samples in the split deployment.
package calculator

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"time"

	"github.com/osmo-rl/osmo"
)

// Name is the workflow's registered name.
const Name = "calculator"

// Loop is the calculator agent loop. The zero value is ready to use.
type Loop struct{}

var _ osmo.RolloutAgentLoop = Loop{}

// Name implements osmo.RolloutAgentLoop.
func (Loop) Name() string { return Name }

// Tools are the OpenAI function schemas of add and multiply.
func Tools() []osmo.Tool {
	return []osmo.Tool{binaryTool("add", "Add two numbers"), binaryTool("multiply", "Multiply two numbers")}
}

func binaryTool(name, description string) osmo.Tool {
	return osmo.Tool{
		"type": "function",
		"function": map[string]any{
			"name":        name,
			"description": description,
			"parameters": map[string]any{
				"type": "object",
				"properties": map[string]any{
					"a": map[string]any{"type": "number"},
					"b": map[string]any{"type": "number"},
				},
				"required": []any{"a", "b"},
			},
		},
	}
}

// GetTools implements osmo.RolloutAgentLoop.
func (Loop) GetTools(*osmo.RolloutRequest) ([]osmo.Tool, error) { return Tools(), nil }

// Run implements osmo.RolloutAgentLoop: call the policy, run the tools it
// asks for, and stop on a plain answer, the turn budget or the token budget.
func (Loop) Run(ctx context.Context, rc *osmo.RolloutContext) (*osmo.RolloutResult, error) {
	messages := osmo.CloneMessages(rc.Request.Messages)
	finish := "max_turns"
	completionTokens := 0
	for turn := 0; turn < rc.Request.MaxTurns; turn++ {
		rc.LogEvent("pre_llm", map[string]any{"turn": turn, "num_messages": len(messages)})
		res, err := rc.Chat(ctx, messages, nil)
		if err != nil {
			return nil, fmt.Errorf("turn %d: %w", turn, err)
		}
		messages = append(messages, res.Message)
		completionTokens += res.Usage.CompletionTokens
		if completionTokens >= rc.Request.MaxTokensTotal {
			finish = "max_tokens"
			break
		}
		if !res.HasToolCalls() {
			finish = cmp.Or(res.FinishReason, "stop")
			break
		}
		start := time.Now()
		results := osmo.ExecuteToolCalls(ctx, res.ToolCalls, execute)
		elapsed := time.Since(start)
		for range res.ToolCalls {
			rc.RecordToolCall(elapsed / time.Duration(len(res.ToolCalls)))
		}
		messages = append(messages, results...)
		rc.LogEvent("tools_executed", map[string]any{"turn": turn, "num_tools": len(res.ToolCalls)})
	}
	return rc.Complete(messages, finish, nil), nil
}

// execute runs one add or multiply call.
func execute(_ context.Context, tc osmo.ToolCall) osmo.Message {
	id, name, args, err := osmo.GetToolCallInfo(tc)
	if err != nil {
		return osmo.ToolErrorResult(id, err.Error())
	}
	a, errA := number(args, "a")
	b, errB := number(args, "b")
	if errA != nil || errB != nil {
		return osmo.ToolErrorResult(id, fmt.Sprintf("%s: %v", name, cmp.Or(errA, errB)))
	}
	switch name {
	case "add":
		return osmo.ToolResult(id, osmo.SerializeToolResult(a+b))
	case "multiply":
		return osmo.ToolResult(id, osmo.SerializeToolResult(math.Round(a*b*1e4)/1e4))
	}
	return osmo.ToolErrorResult(id, "Unknown tool: "+name)
}

func number(args map[string]any, key string) (float64, error) {
	v, ok := args[key]
	if !ok {
		return 0, fmt.Errorf("missing argument %q", key)
	}
	f, ok := v.(float64)
	if !ok || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("argument %q must be a number, got %v", key, v)
	}
	return f, nil
}
