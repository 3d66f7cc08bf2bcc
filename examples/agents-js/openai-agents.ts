// An OpenAI Agents SDK agent run by `osmo serve --exec`, one process per
// sample (the contract is in contract.ts). It is the agent of the Osmosis
// OpenAI Agents integration: a multiply tool, the placeholder model, and a
// memory session whose persisted items become the sample's messages.
//
//   osmo serve --exec "node_modules/.bin/tsx openai-agents.ts"
import {
  Agent,
  type AgentInputItem,
  MemorySession,
  OpenAIProvider,
  Runner,
  setTracingDisabled,
  tool,
} from '@openai/agents';
import { z } from 'zod';

import {
  type ChatMessage,
  configNumber,
  ContractError,
  contentText,
  emitMessages,
  PLACEHOLDER_MODEL,
  policyEndpoint,
  readSampleInput,
  runMain,
} from './contract.ts';

const multiply = tool({
  name: 'multiply',
  description: 'Multiply two integers.',
  parameters: z.object({ a: z.number().int(), b: z.number().int() }),
  execute: async ({ a, b }) => String(a * b),
});

/** Turns the prompt's chat messages into Agents SDK input items. */
function toAgentInput(prompt: ChatMessage[]): AgentInputItem[] {
  return prompt.map((m, i): AgentInputItem => {
    const text = contentText(m.content);
    switch (m.role) {
      case 'system':
      case 'developer':
        return { role: 'system', content: text };
      case 'user':
        return { role: 'user', content: text };
      case 'assistant':
        return { role: 'assistant', status: 'completed', content: [{ type: 'output_text', text }] };
      default:
        throw new ContractError(`stdin: "prompt[${i}].role" ${JSON.stringify(m.role)} is not system, user or assistant`);
    }
  });
}

runMain('openai-agents', async () => {
  const endpoint = policyEndpoint();
  const sample = await readSampleInput();

  // Traces would otherwise be exported to OpenAI with the per-rollout token.
  setTracingDisabled(true);
  const runner = new Runner({
    // Chat Completions, as the Osmosis integration calls the policy; the
    // proxy also serves the Responses API (see defaults-openai-agents.ts).
    modelProvider: new OpenAIProvider({ baseURL: endpoint.baseURL, apiKey: endpoint.apiKey, useResponses: false }),
    tracingDisabled: true,
  });
  const agent = new Agent({
    name: 'multiply-agent',
    instructions: 'Use the multiply tool when arithmetic is required.',
    model: PLACEHOLDER_MODEL,
    modelSettings: {
      temperature: configNumber(sample.config, 'temperature', 1.0),
      maxTokens: configNumber(sample.config, 'max_tokens', 4096),
    },
    tools: [multiply],
  });
  const session = new MemorySession({ sessionId: endpoint.sampleID || 'multiply-agent' });
  await runner.run(agent, toAgentInput(sample.prompt), {
    session,
    maxTurns: configNumber(sample.config, 'max_turns', 10),
  });
  emitMessages(await session.getItems());
});
