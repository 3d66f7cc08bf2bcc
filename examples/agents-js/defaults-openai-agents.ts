// An OpenAI Agents SDK program as the SDK's quickstart writes it: no model
// named, the SDK's default model provider (the Responses API), the client
// configured by OPENAI_BASE_URL and OPENAI_API_KEY. It knows nothing of
// osmo beyond the exec contract's stdin and last stdout line, and runs as
//
//   osmo serve --exec "node_modules/.bin/tsx defaults-openai-agents.ts [--stream]"
//
// The proxy translates its Responses calls to chat completions for the
// policy, and pins whatever model the SDK names to the policy.
import { Agent, type AgentInputItem, run, tool } from '@openai/agents';
import { z } from 'zod';

const multiply = tool({
  name: 'multiply',
  description: 'Multiply two integers.',
  parameters: z.object({ a: z.number().int(), b: z.number().int() }),
  execute: async ({ a, b }) => String(a * b),
});

const agent = new Agent({
  name: 'multiply-agent',
  instructions: 'Use the multiply tool when arithmetic is required.',
  tools: [multiply],
});

let stdin = '';
for await (const chunk of process.stdin) stdin += chunk;
const { prompt } = JSON.parse(stdin) as { prompt: Array<{ role: string; content: string }> };
const input = prompt.map((m): AgentInputItem => {
  switch (m.role) {
    case 'system':
      return { role: 'system', content: m.content };
    case 'assistant':
      return { role: 'assistant', status: 'completed', content: [{ type: 'output_text', text: m.content }] };
    default:
      return { role: 'user', content: m.content };
  }
});

if (process.argv.includes('--stream')) {
  const result = await run(agent, input, { stream: true });
  await result.completed;
  console.log(JSON.stringify({ messages: result.history }));
} else {
  const result = await run(agent, input);
  console.log(JSON.stringify({ messages: result.history }));
}
