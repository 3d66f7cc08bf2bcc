// A Strands Agents program as the SDK's documentation writes it: an
// OpenAIModel naming an OpenAI model, with the SDK's defaults otherwise (the
// Responses API, streamed), the client configured by OPENAI_BASE_URL and
// OPENAI_API_KEY. It knows nothing of osmo beyond the exec contract's stdin
// and last stdout line, and runs as
//
//   osmo serve --exec "node_modules/.bin/tsx defaults-strands.ts"
//
// The proxy translates its Responses calls to chat completions for the
// policy, and pins the model it names to the policy.
import { Agent, tool } from '@strands-agents/sdk';
import { OpenAIModel } from '@strands-agents/sdk/models/openai';
import { z } from 'zod';

const multiply = tool({
  name: 'multiply',
  description: 'Multiply two integers.',
  inputSchema: z.object({ a: z.number().int(), b: z.number().int() }),
  callback: ({ a, b }) => String(a * b),
});

let stdin = '';
for await (const chunk of process.stdin) stdin += chunk;
const { prompt } = JSON.parse(stdin) as { prompt: Array<{ role: string; content: string }> };
const question = prompt.filter((m) => m.role === 'user').at(-1)?.content ?? '';

const agent = new Agent({
  model: new OpenAIModel({ modelId: 'gpt-4o' }),
  tools: [multiply],
  systemPrompt: 'Use the multiply tool when arithmetic is required.',
  printer: false,
});
await agent.invoke(question);
console.log(JSON.stringify({ messages: agent.messages }));
