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
//   - RolloutAgentLoop (the remote-rollout contract, G1 below): the service calls
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
// # Wire generations
//
// The Osmosis SDK changed its rollout wire twice; osmo serves all three at
// once, and the code names them:
//
//   - G1, the remote-rollout protocol: the trainer posts /v1/rollout/init,
//     the agent's LLM calls go to the trainer's server_url, and osmo posts
//     one /v1/rollout/completed callback per rollout, with the reward.
//   - G2, SDK v0.2: POST /rollout with an AgentWorkflow and a Grader; a
//     completion callback after the run and a grader callback after grading,
//     whose samples map carries the rewards.
//   - v0.3 (called G3 in places), today's SDK: the G2 body plus llm_api_key;
//     POST /rollout answers 202 (429 at capacity), the grader callback
//     carries one sample with its recorded LLM calls, and status and cancel
//     endpoints exist.
//
// G2 and v0.3 share POST /rollout and nothing in a request says which one
// sent it, so osmo answers what both expect.
//
// Build your own server binary by passing your loops and graders to
// github.com/osmo-rl/osmo/cli.Main; see examples/. A workflow's, agent
// loop's or grader's tests run it as the rollout service does with package
// github.com/osmo-rl/osmo/osmotest.
package osmo
