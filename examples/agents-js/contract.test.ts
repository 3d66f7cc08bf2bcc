import assert from 'node:assert/strict';
import { Readable } from 'node:stream';
import { describe, test } from 'node:test';

import { configNumber, ContractError, contentText, describe as describeError, parseSampleInput, policyEndpoint, readSampleInput } from './contract.ts';

describe('parseSampleInput', () => {
  test('accepts the runner document and defaults metadata and config', () => {
    const got = parseSampleInput('{"prompt":[{"role":"user","content":"hi"}]}');
    assert.deepEqual(got, { prompt: [{ role: 'user', content: 'hi' }], metadata: {}, config: {} });
  });
  test('reads null metadata and config as none given', () => {
    const got = parseSampleInput('{"prompt":[{"role":"user","content":"hi"}],"metadata":null,"config":null}');
    assert.deepEqual(got, { prompt: [{ role: 'user', content: 'hi' }], metadata: {}, config: {} });
  });
  const bad: Array<[string, string, RegExp]> = [
    ['not JSON', '{', /stdin: not a JSON object/],
    ['not an object', '[1]', /stdin: not a JSON object/],
    ['no prompt', '{}', /"prompt" must be a non-empty array/],
    ['empty prompt', '{"prompt":[]}', /"prompt" must be a non-empty array/],
    ['message without role', '{"prompt":[{"content":"hi"}]}', /"prompt\[0\]\.role"/],
    ['content of the wrong type', '{"prompt":[{"role":"user","content":3}]}', /"prompt\[0\]\.content"/],
    ['metadata not an object', '{"prompt":[{"role":"user"}],"metadata":[]}', /"metadata" must be an object/],
    ['config not an object', '{"prompt":[{"role":"user"}],"config":"x"}', /"config" must be an object/],
  ];
  for (const [name, text, want] of bad) {
    test(`rejects ${name}`, () => {
      assert.throws(() => parseSampleInput(text), (err: unknown) => err instanceof ContractError && want.test(err.message));
    });
  }
});

test('readSampleInput reads the whole stream', async () => {
  const doc = '{"prompt":[{"role":"user","content":"What is 6 times 7?"}],"config":{"temperature":0.5}}';
  const got = await readSampleInput(Readable.from([Buffer.from(doc.slice(0, 10)), Buffer.from(doc.slice(10))]));
  assert.equal(got.prompt[0]?.content, 'What is 6 times 7?');
  assert.equal(configNumber(got.config, 'temperature', 1), 0.5);
  assert.equal(configNumber(got.config, 'max_tokens', 4096), 4096);
  assert.throws(() => configNumber({ temperature: 'hot' }, 'temperature', 1), /"config.temperature" must be a number/);
});

test('policyEndpoint names the missing variable', () => {
  assert.throws(() => policyEndpoint({}), /OPENAI_BASE_URL/);
  assert.throws(() => policyEndpoint({ OPENAI_BASE_URL: 'http://127.0.0.1:1/v1' }), /OPENAI_API_KEY/);
  const ep = policyEndpoint({ OSMOSIS_CHAT_COMPLETIONS_URL: 'http://127.0.0.1:1/v1', OPENAI_API_KEY: 'k', OSMOSIS_SAMPLE_ID: 's' });
  assert.equal(ep.baseURL, 'http://127.0.0.1:1/v1');
  assert.equal(ep.sampleID, 's');
});

test('contentText flattens parts', () => {
  assert.equal(contentText('plain'), 'plain');
  assert.equal(contentText([{ type: 'text', text: 'a' }, { type: 'image_url' }, { type: 'text', text: 'b' }]), 'a\nb');
  assert.equal(contentText(null), '');
});

test('describe names the cause once', () => {
  const root = Object.assign(new Error('500 upstream failed'), { status: 502 });
  const wrapped = new Error('500 upstream failed', { cause: root });
  wrapped.name = 'ModelError';
  assert.equal(describeError(wrapped), 'ModelError: 500 upstream failed: caused by Error (HTTP 502)');
  assert.equal(describeError('boom'), 'boom');
});
