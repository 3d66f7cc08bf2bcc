// Package osmo is the Go SDK for writing rollout workflows and graders that
// run under the osmo rollout service.
//
// Two contracts are supported, mirroring the Osmosis SDK:
//
//   - RolloutAgentLoop (the remote-rollout, "G1" contract): the service calls
//     GetTools when a trainer posts /v1/rollout/init, then Run with a
//     RolloutContext whose Chat method reaches the trainer's current policy
//     through the LLM proxy. The loop ends with ctx.Complete or ctx.Error.
//
//   - Grader: receives every sample of a finished rollout, keyed by sample id,
//     and sets a finite reward on each (or removes it).
//
// Tool helpers (GetToolCallInfo, ToolResult, ToolErrorResult,
// SerializeToolResult, ExecuteToolCalls) have the semantics of the Osmosis
// Python helpers of the same names.
//
// Build your own server binary by passing your loops and graders to
// github.com/osmo-rl/osmo/cli.Main; see examples/.
package osmo
