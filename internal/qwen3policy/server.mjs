// A vLLM-like OpenAI-compatible policy for tests: it renders Qwen3's chat
// template, tokenizes with Qwen3's tokenizer, writes a scripted completion
// and answers in vLLM's layout (token ids and logprobs only when asked).
// See README.md for the scenarios, faults and flags.
//
//   node server.mjs --port 0 --scenario reasoning
//
// It prints "listening on http://HOST:PORT" on stdout once it serves.
import { randomUUID } from 'node:crypto';
import http from 'node:http';
import { parseArgs } from 'node:util';

import {
  ENGINE_ONLY_FIELDS,
  FAULTS,
  IM_END,
  OUT_OF_VOCAB_ID,
  RequestError,
  SCENARIOS,
  THINK_END,
  THINK_START,
  TOOL_CALL_END,
  TOOL_CALL_START,
  conversationOf,
  generate,
  loadModel,
  logprobOf,
  parseReasoning,
  parseToolCalls,
  renderPrompt,
  scenarioOf,
  thinkingOf,
  tokenTexts,
  toolsOf,
} from './policy.mjs';

const { values: flags } = parseArgs({
  options: {
    host: { type: 'string', default: '127.0.0.1' },
    port: { type: 'string', default: '0' },
    scenario: { type: 'string', default: 'plain' },
    fault: { type: 'string', default: '' },
    'reasoning-field': { type: 'string', default: 'reasoning' },
    'max-body-bytes': { type: 'string', default: String(8 << 20) },
  },
  strict: true,
});

function usage(message) {
  process.stderr.write(`qwen3policy: ${message}\n`);
  process.exit(2);
}
if (!SCENARIOS.includes(flags.scenario)) usage(`--scenario must be one of ${SCENARIOS.join(', ')}`);
if (flags.fault !== '' && !FAULTS.includes(flags.fault)) usage(`--fault must be empty or one of ${FAULTS.join(', ')}`);
if (!['reasoning', 'reasoning_content'].includes(flags['reasoning-field'])) usage('--reasoning-field must be reasoning or reasoning_content');
const port = Number(flags.port);
const maxBody = Number(flags['max-body-bytes']);
if (!Number.isInteger(port) || port < 0 || port > 65535) usage('--port must be 0 to 65535');
if (!Number.isInteger(maxBody) || maxBody <= 0) usage('--max-body-bytes must be a positive integer');

const defaults = { scenario: flags.scenario, fault: flags.fault };
const reasoningField = flags['reasoning-field'];
const model = loadModel();
const maxModelLen = 40960;

// Every chat request in arrival order, with what the policy saw and generated.
let records = [];

function hex() {
  return randomUUID().replaceAll('-', '');
}

function sendJSON(res, status, body) {
  const data = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) });
  res.end(data);
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    req.on('data', (c) => {
      size += c.length;
      if (size > maxBody) {
        // The rest is read and dropped, so the 413 reaches the client.
        chunks.length = 0;
        reject(new RequestError(413, `request body is over ${maxBody} bytes`));
        return;
      }
      chunks.push(c);
    });
    req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    req.on('error', reject);
  });
}

function optionalBool(body, key) {
  const v = body[key];
  if (v !== undefined && v !== null && typeof v !== 'boolean') throw new RequestError(400, `${key} must be a boolean`, { param: key });
  return v === true;
}

function optionalInt(body, key, min, max) {
  const v = body[key];
  if (v === undefined || v === null) return null;
  if (!Number.isInteger(v) || v < min || v > max) throw new RequestError(400, `${key} must be an integer from ${min} to ${max}`, { param: key });
  return v;
}

/**
 * logprobs.content entries as vLLM writes them: the token's text (or
 * "token_id:N" with return_tokens_as_token_ids), its logprob, its UTF-8
 * bytes, the top alternatives.
 */
function logprobEntries(c) {
  const { ids, logprobs: lps, top, asIDs } = c;
  const tokenString = (id) => (asIDs ? `token_id:${id}` : model.tokenizer.decode([id], { skip_special_tokens: false }));
  return ids.map((id, i) => {
    const token = tokenString(id);
    const alternatives = [];
    for (let k = 0; k < top; k++) {
      const alt = k === 0 ? id : (id + k) % model.vocabSize;
      const altToken = tokenString(alt);
      alternatives.push({ token: altToken, logprob: lps[i] - k, bytes: [...Buffer.from(altToken, 'utf8')] });
    }
    return { token, logprob: lps[i], bytes: [...Buffer.from(token, 'utf8')], top_logprobs: alternatives };
  });
}

/** The completion for a validated request: everything both response shapes and the record need. */
function complete(body, scenario) {
  const stream = optionalBool(body, 'stream');
  const askIDs = optionalBool(body, 'return_token_ids');
  const askLogprobs = optionalBool(body, 'logprobs');
  const top = optionalInt(body, 'top_logprobs', 0, 20) ?? 0;
  optionalInt(body, 'n', 1, 1);
  const limit = optionalInt(body, 'max_completion_tokens', 1, Number.MAX_SAFE_INTEGER) ?? optionalInt(body, 'max_tokens', 1, Number.MAX_SAFE_INTEGER);
  const conversation = conversationOf(body.messages, reasoningField);
  const tools = toolsOf(body.tools);
  const toolChoice = body.tool_choice ?? (tools && tools.length > 0 ? 'auto' : 'none');
  const thinking = thinkingOf(body, scenario);
  const prompt = renderPrompt(model, conversation, tools, thinking);

  const text = generate({ scenario, conversation, tools, toolChoice, thinking });
  let ids = model.tokenizer.encode(text, { add_special_tokens: false });
  let finish = 'stop';
  if (limit !== null && ids.length + 1 > limit) {
    ids = ids.slice(0, limit);
    finish = 'length';
  } else {
    ids.push(IM_END);
  }
  // The text as vLLM detokenizes it: the stop token is not part of it.
  const completion = finish === 'stop' ? text : model.tokenizer.decode(ids, { skip_special_tokens: false });
  const seed = prompt.ids.join(',');
  const logprobs = ids.map((id, i) => logprobOf(seed, i, id));

  const { reasoning, content } = parseReasoning(completion);
  const parsed = toolChoice !== 'none' ? parseToolCalls(content) : { toolCalls: [], content };
  const message = {
    role: 'assistant',
    content: parsed.content,
    refusal: null,
    annotations: null,
    audio: null,
    function_call: null,
    tool_calls: parsed.toolCalls,
    [reasoningField]: reasoning,
  };
  return {
    stream,
    askIDs,
    askLogprobs,
    top,
    asIDs: optionalBool(body, 'return_tokens_as_token_ids'),
    includeUsage: body.stream_options?.include_usage === true,
    toolResultSeen: conversation.some((m) => m.role === 'tool'),
    thinking,
    prompt,
    completion,
    ids,
    logprobs,
    message,
    finishReason: parsed.toolCalls.length > 0 ? 'tool_calls' : finish,
  };
}

async function chat(req, res) {
  const record = { model: null, scenario: defaults.scenario, fault: '', stream: false, status: 200 };
  records.push(record);
  try {
    let body;
    try {
      body = JSON.parse(await readBody(req));
    } catch (err) {
      if (err instanceof RequestError) throw err;
      throw new RequestError(400, `request body is not JSON: ${err.message}`);
    }
    if (body === null || typeof body !== 'object' || Array.isArray(body)) throw new RequestError(400, 'request body must be a JSON object');
    const { scenario, fault } = scenarioOf(body.model, defaults);
    Object.assign(record, { model: body.model ?? null, scenario, stream: body.stream === true });
    if (fault === 'hosted') {
      const field = ENGINE_ONLY_FIELDS.find((k) => k in body);
      if (field !== undefined) {
        record.fault = 'hosted';
        throw new RequestError(400, `Unrecognized request argument supplied: ${field}`, { type: 'invalid_request_error', code: null });
      }
    }
    const c = complete(body, scenario);
    // Faults other than hosted hit the calls that follow a tool result, so a
    // conversation has a clean first call and faulty later ones.
    const applied = fault === 'hosted' ? 'hosted' : fault !== '' && c.toolResultSeen ? fault : '';
    Object.assign(record, {
      fault: applied,
      enable_thinking: c.thinking,
      asked_token_ids: c.askIDs,
      asked_logprobs: c.askLogprobs,
      prompt: c.prompt.text,
      prompt_ids: c.prompt.ids,
      completion: c.completion,
      completion_ids: c.ids,
      logprobs: c.logprobs,
      message: c.message,
      finish_reason: c.finishReason,
    });
    const reply = {
      id: `chatcmpl-${hex()}`,
      created: Math.floor(Date.now() / 1000),
      model: body.model ?? 'qwen3',
      hosted: fault === 'hosted',
      fault: applied,
    };
    if (c.stream) streamReply(res, reply, c);
    else jsonReply(res, reply, c);
  } catch (err) {
    if (!(err instanceof RequestError)) throw err;
    record.status = err.status;
    record.error = err.message;
    sendJSON(res, err.status, err.body);
  }
}

/** The ids as returned under a fault: what a broken engine or proxy would send. */
function returnedIDs(ids, fault) {
  switch (fault) {
    case 'badlen':
      return ids.slice(0, -1);
    case 'badid':
      return [OUT_OF_VOCAB_ID, ...ids.slice(1)];
    default:
      return ids;
  }
}

function usageOf(c) {
  return {
    prompt_tokens: c.prompt.ids.length,
    total_tokens: c.prompt.ids.length + c.ids.length,
    completion_tokens: c.ids.length,
    prompt_tokens_details: null,
  };
}

function jsonReply(res, reply, c) {
  const withIDs = c.askIDs && reply.fault !== 'noids';
  const choice = {
    index: 0,
    message: { ...c.message },
    logprobs: c.askLogprobs ? { content: logprobEntries(c) } : null,
    finish_reason: c.finishReason,
    stop_reason: null,
    token_ids: withIDs ? returnedIDs(c.ids, reply.fault) : null,
  };
  let body = {
    id: reply.id,
    object: 'chat.completion',
    created: reply.created,
    model: reply.model,
    choices: [choice],
    service_tier: null,
    system_fingerprint: null,
    usage: usageOf(c),
    prompt_logprobs: null,
    prompt_token_ids: withIDs ? c.prompt.ids : null,
    kv_transfer_params: null,
  };
  if (reply.hosted) {
    delete choice.stop_reason;
    delete choice.token_ids;
    delete choice.message[reasoningField];
    const { prompt_logprobs: _a, prompt_token_ids: _b, kv_transfer_params: _c, ...rest } = body;
    body = rest;
  }
  if (reply.fault === 'cut') {
    // Half a body, then the connection drops.
    const data = JSON.stringify(body);
    res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) });
    res.write(data.slice(0, Math.floor(data.length / 2)), () => res.destroy());
    return;
  }
  sendJSON(res, 200, body);
}

/**
 * The deltas vLLM's streaming parsers give token by token: reasoning between
 * <think> and </think> (the tags themselves give none), content outside tool
 * calls, and for each tool call its id, type and name once the name is
 * written, then its arguments (the parser's re-dumped string) with its
 * </tool_call>. null is a token that gives no delta.
 */
function deltas(c) {
  const texts = tokenTexts(model.tokenizer, c.ids);
  const thinks = c.message[reasoningField] !== null;
  const calls = c.message.tool_calls;
  let inThink = false;
  let inCall = false;
  let named = false;
  let callText = '';
  let call = 0;
  return c.ids.map((id, i) => {
    if (thinks && id === THINK_START && !inThink && call === 0) {
      inThink = true;
      return null;
    }
    if (inThink) {
      if (id === THINK_END) {
        inThink = false;
        return null;
      }
      return { [reasoningField]: texts[i] };
    }
    if (id === IM_END) return {};
    if (calls.length > 0) {
      if (id === TOOL_CALL_START) {
        inCall = true;
        named = false;
        callText = '';
        return null;
      }
      if (inCall) {
        const tc = calls[call];
        const head = { index: call, id: tc.id, type: 'function', function: { name: tc.function.name } };
        if (id === TOOL_CALL_END) {
          inCall = false;
          call++;
          const args = { arguments: tc.function.arguments };
          return { tool_calls: [named ? { index: head.index, function: args } : { ...head, function: { ...head.function, ...args } }] };
        }
        callText += texts[i];
        if (!named && /"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,/.test(callText)) {
          named = true;
          return { tool_calls: [head] };
        }
        return null;
      }
    }
    return { content: texts[i] };
  });
}

function streamReply(res, reply, c) {
  const withIDs = c.askIDs && reply.fault !== 'noids' && !reply.hosted;
  const ids = returnedIDs(c.ids, reply.fault);
  const head = { id: reply.id, object: 'chat.completion.chunk', created: reply.created, model: reply.model };
  const chunks = [];
  const first = { ...head, choices: [{ index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }] };
  if (!reply.hosted) first.prompt_token_ids = withIDs ? c.prompt.ids : null;
  chunks.push(first);
  const entries = c.askLogprobs ? logprobEntries(c) : null;
  // A hosted API has no reasoning field: those tokens give no delta.
  const ds = deltas(c).map((d) => (reply.hosted && d !== null && reasoningField in d ? null : d));
  ds.forEach((delta, i) => {
    const last = i === ds.length - 1;
    // vLLM sends no chunk for a token without a delta unless token ids were
    // asked for (its logprobs go with it).
    if (delta === null && !last && !c.askIDs) return;
    const choice = {
      index: 0,
      delta: delta ?? {},
      logprobs: entries ? { content: [entries[i]] } : null,
      finish_reason: last ? c.finishReason : null,
    };
    if (!reply.hosted) {
      if (last) choice.stop_reason = null;
      // badlen: the stop token's id goes missing from the last chunk.
      choice.token_ids = withIDs ? (reply.fault === 'badlen' && last ? [] : [ids[i]]) : null;
    }
    chunks.push({ ...head, choices: [choice] });
  });
  if (c.includeUsage) {
    const { prompt_tokens_details: _, ...usage } = usageOf(c);
    chunks.push({ ...head, choices: [], usage });
  }
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
  const cutAt = reply.fault === 'cut' ? Math.max(1, Math.floor(chunks.length / 2)) : chunks.length;
  for (const chunk of chunks.slice(0, cutAt)) res.write(`data: ${JSON.stringify(chunk)}\n\n`);
  if (cutAt < chunks.length) {
    res.write('', () => res.destroy());
    return;
  }
  res.end('data: [DONE]\n\n');
}

function models(res) {
  const created = Math.floor(Date.now() / 1000);
  const names = ['qwen3', ...SCENARIOS.map((s) => `qwen3-${s}`)];
  sendJSON(res, 200, {
    object: 'list',
    data: names.map((id) => ({ id, object: 'model', created, owned_by: 'vllm', root: 'Qwen/Qwen3-8B', parent: null, max_model_len: maxModelLen, permission: [] })),
  });
}

const server = http.createServer((req, res) => {
  const path = new URL(req.url, 'http://x').pathname;
  const route = `${req.method} ${path}`;
  const done = (p) =>
    p.catch((err) => {
      process.stderr.write(`qwen3policy: ${route}: ${err.stack ?? err}\n`);
      if (!res.headersSent) sendJSON(res, 500, { error: { message: String(err.message ?? err), type: 'InternalServerError', param: null, code: 500 } });
      else res.destroy();
    });
  switch (route) {
    case 'POST /v1/chat/completions':
      done(chat(req, res));
      return;
    case 'GET /v1/models':
      models(res);
      return;
    case 'GET /health':
      res.writeHead(200, { 'content-length': 0 });
      res.end();
      return;
    case 'GET /record':
      sendJSON(res, 200, { requests: records });
      return;
    case 'POST /record/reset':
      records = [];
      sendJSON(res, 200, {});
      return;
    default:
      sendJSON(res, 404, { detail: 'Not Found' });
  }
});

server.listen(port, flags.host, () => {
  const { address, port: bound } = server.address();
  const host = address.includes(':') ? `[${address}]` : address;
  process.stdout.write(`listening on http://${host}:${bound}\n`);
});

for (const sig of ['SIGTERM', 'SIGINT']) {
  process.on(sig, () => {
    server.close(() => process.exit(0));
    server.closeAllConnections();
  });
}
