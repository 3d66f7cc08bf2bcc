package osmo_test

import (
	"context"
	"fmt"

	"github.com/osmo-rl/osmo"
)

// A tool executor in the shape of the Osmosis guide: parse the call, run it,
// answer with a tool message; bad arguments become a tool error the model sees.
func ExampleExecuteToolCalls() {
	calls := []osmo.ToolCall{
		{ID: "call_1", Type: "function", Function: osmo.FunctionCall{Name: "add", Arguments: `{"a": 2, "b": 3}`}},
		{ID: "call_2", Type: "function", Function: osmo.FunctionCall{Name: "add", Arguments: `{"a": 2,`}},
	}
	results := osmo.ExecuteToolCalls(context.Background(), calls, func(_ context.Context, tc osmo.ToolCall) osmo.Message {
		id, _, args, err := osmo.GetToolCallInfo(tc)
		if err != nil {
			return osmo.ToolErrorResult(id, err.Error())
		}
		a, _ := args["a"].(float64)
		b, _ := args["b"].(float64)
		return osmo.ToolResult(id, osmo.SerializeToolResult(a+b))
	})
	for _, r := range results {
		fmt.Println(r["tool_call_id"], r["content"])
	}
	// Output:
	// call_1 5
	// call_2 Error: invalid arguments for tool "add" (call call_2): unexpected end of JSON input
}

// A reward function in the shape of @osmosis_reward, used as a Grader.
func ExampleRewardGrader() {
	exact := osmo.RewardGrader(func(solution, groundTruth string, _ map[string]any) (float64, error) {
		if solution == groundTruth {
			return 1, nil
		}
		return 0, nil
	})
	label := "42"
	// The grader service builds the context; a test writes one out.
	gc := &osmo.GraderContext{
		RolloutID: "rollout-1",
		Samples: map[string]*osmo.Sample{
			"agent": {ID: "agent", Messages: []osmo.Message{{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "42"}}},
		},
		Label: &label,
	}
	if err := exact.Grade(context.Background(), gc); err != nil {
		fmt.Println(err)
	}
	r, _ := gc.Reward("agent")
	fmt.Println(r)
	// Output: 1
}
