// A Strands Agents agent run by `osmo serve --exec`, one process per sample
// (the contract is in contract.ts). It is the agent of the Osmosis Strands
// integration: a calculator tool, the placeholder model over Chat
// Completions, and the agent's own messages (toolUse / toolResult blocks) as
// the sample's messages.
//
//   osmo serve --exec "node_modules/.bin/tsx strands.ts"
import { Agent, type MessageData, tool } from '@strands-agents/sdk';
import { OpenAIModel } from '@strands-agents/sdk/models/openai';
import { z } from 'zod';

import { evaluate, formatResult } from './arithmetic.ts';
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

const SYSTEM_PROMPT = 'You are a math assistant. Use the calculator tool.';

const calculator = tool({
  name: 'calculator',
  description: 'Evaluate a math expression.',
  inputSchema: z.object({ expression: z.string().describe('An arithmetic expression, e.g. "(2 + 3) * 4".') }),
  callback: ({ expression }) => formatResult(evaluate(expression)),
});

/**
 * Splits the prompt into the system prompt and Strands messages: Strands
 * keeps the system prompt apart and knows only user and assistant turns.
 */
function toStrands(prompt: ChatMessage[]): { system: string[]; messages: MessageData[] } {
  const system: string[] = [];
  const messages: MessageData[] = [];
  prompt.forEach((m, i) => {
    const text = contentText(m.content);
    switch (m.role) {
      case 'system':
      case 'developer':
        system.push(text);
        break;
      case 'user':
      case 'assistant':
        messages.push({ role: m.role, content: [{ text }] });
        break;
      default:
        throw new ContractError(`stdin: "prompt[${i}].role" ${JSON.stringify(m.role)} is not system, user or assistant`);
    }
  });
  if (messages.at(-1)?.role !== 'user') {
    throw new ContractError('stdin: "prompt" must end with a user message');
  }
  return { system, messages };
}

runMain('strands', async () => {
  const endpoint = policyEndpoint();
  const sample = await readSampleInput();
  const { system, messages } = toStrands(sample.prompt);

  const model = new OpenAIModel({
    // Chat Completions, as the Osmosis Strands integration calls the policy;
    // the default, the Responses API, works too (see defaults-strands.ts).
    api: 'chat',
    modelId: PLACEHOLDER_MODEL,
    apiKey: endpoint.apiKey,
    clientConfig: { baseURL: endpoint.baseURL },
    temperature: configNumber(sample.config, 'temperature', 1.0),
    maxTokens: configNumber(sample.config, 'max_tokens', 4096),
  });
  const agent = new Agent({
    name: 'math-agent',
    model,
    tools: [calculator],
    systemPrompt: [SYSTEM_PROMPT, ...system].join('\n\n'),
    // The printer writes the conversation to stdout, where only the final
    // messages line belongs.
    printer: false,
  });
  await agent.invoke(messages);
  emitMessages(agent.messages);
});
