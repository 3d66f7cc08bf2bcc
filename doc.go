// Package osmo is the Go SDK for writing rollout workflows and graders that
// run under the osmo rollout service.
//
// Three contracts are supported, mirroring the Osmosis SDK:
//
//   - AgentWorkflow[T]: Run is called once per rollout with the row's prompt
//     and metadata; it builds its agents inside (see the integrations), routes
//     their LLM calls through the rollout (Rollout.Endpoint) and registers each
//     conversation to grade as a sample source. NewWorkflow binds it to its
//     config.
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
// github.com/osmo-rl/osmo/cli.Main; see examples/. What runs workflows (the
// rollout service, the evaluator, a workflow's tests) uses package
// github.com/osmo-rl/osmo/host, which authors do not need.
package osmo
