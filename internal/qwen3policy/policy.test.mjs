// Unit tests of the parsers and the JSON writer: node --test
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { Template } from '@huggingface/jinja';

import { parseReasoning, parseToolCalls, pyJSON, scenarioOf } from './policy.mjs';

test('pyJSON writes what the template tojson writes', () => {
  const v = { a: [1, 2.5, { b: 'é\n"x' }], c: {}, d: [], e: null, f: true };
  assert.equal(pyJSON(v), new Template('{{ v | tojson }}').render({ v }));
});

test('reasoning needs both tags; content after </think> is kept as is', () => {
  assert.deepEqual(parseReasoning('<think>\nhm\n</think>\n\nok'), { reasoning: '\nhm\n', content: '\n\nok' });
  assert.deepEqual(parseReasoning('<think>\nhm\n</think>'), { reasoning: '\nhm\n', content: null });
  assert.deepEqual(parseReasoning('no tags'), { reasoning: null, content: 'no tags' });
  assert.deepEqual(parseReasoning('<think>unclosed'), { reasoning: null, content: '<think>unclosed' });
});

test('tool calls: arguments re-dumped, content before the first call, null when empty', () => {
  const { toolCalls, content } = parseToolCalls('\n\n<tool_call>\n{"name": "f", "arguments": {"a":3,"b":4}}\n</tool_call>');
  assert.equal(content, '\n\n');
  assert.equal(toolCalls.length, 1);
  assert.equal(toolCalls[0].function.arguments, '{"a": 3, "b": 4}');
  assert.match(toolCalls[0].id, /^chatcmpl-tool-[0-9a-f]{32}$/);
  assert.equal(parseToolCalls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>').content, null);
  // A body that is not JSON leaves the text as content, with no calls.
  assert.deepEqual(parseToolCalls('<tool_call>\n{"name": "f", "argu'), { toolCalls: [], content: '<tool_call>\n{"name": "f", "argu' });
});

test('the model names the scenario and fault; other names get the defaults', () => {
  const defaults = { scenario: 'plain', fault: '' };
  assert.deepEqual(scenarioOf('qwen3-reasoning', defaults), { scenario: 'reasoning', fault: '' });
  assert.deepEqual(scenarioOf('qwen3-plain-hosted', defaults), { scenario: 'plain', fault: 'hosted' });
  assert.deepEqual(scenarioOf('gpt-4o', defaults), defaults);
  assert.deepEqual(scenarioOf('qwen3-plain-nosuch', defaults), defaults);
});
