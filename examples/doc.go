// Package examples holds agents written for exec workflows, where
// `osmo serve --exec CMD` runs a program once per sample:
//
//   - agents-js/openai-agents.ts: the OpenAI Agents SDK (a multiply tool and a
//     memory session; the session's items are the sample's messages);
//   - agents-js/strands.ts: Strands Agents (a calculator tool; the agent's
//     messages, with toolUse and toolResult blocks, are the sample's messages);
//   - python-stdlib/agent.py: a tool-calling loop in the Python standard
//     library, showing that the contract needs no SDK.
//
// The contract: the environment carries OPENAI_BASE_URL (and the same value
// as OSMOSIS_CHAT_COMPLETIONS_URL), the LLM proxy URL bound to the rollout
// and sample ({proxy}/r/{rollout_id}/s/{sample_id}/v1), OPENAI_API_KEY, a
// per-rollout token, OSMOSIS_ROLLOUT_ID and OSMOSIS_SAMPLE_ID; stdin carries
// one JSON object {"prompt": [...], "metadata": {...}, "config": {...}}.
// When the last stdout line is a JSON object with "messages", those become
// the sample's messages, otherwise the proxy's recording of the conversation
// does. Stderr goes to the rollout's log, and a non-zero exit is an agent
// error. Agents send the placeholder model "openai/osmosis-rollout", which
// the proxy routes to the current policy.
//
// python-trainer/trainer.py is the other side: a trainer, in the Python
// standard library, that streams training rows from a running osmo
// (GET /v1/rows:stream), resumes after its own restart from a committed
// cursor, and turns rows into a PPO/GRPO step's tensors.
//
// eino-agent is a Go workflow built with github.com/cloudwego/eino (a react
// agent with a multiply tool) through integrations/osmoeino; its tests run it
// against the proxy and inside the real rollout service.
//
// The package's tests run each agent as a subprocess against the real proxy
// (pkg/llmproxy) in front of the mock policy (internal/mockllm). The
// JavaScript agents need their dependencies: run `npm ci` in
// examples/agents-js first.
package examples
