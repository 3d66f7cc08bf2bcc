// The exec-workflow contract, shared by the agents in this directory.
//
// osmo serve --exec runs one process per sample:
//   env    OPENAI_BASE_URL (= OSMOSIS_CHAT_COMPLETIONS_URL), the LLM proxy bound
//          to this rollout and sample; OPENAI_API_KEY, a per-rollout token;
//          OSMOSIS_ROLLOUT_ID, OSMOSIS_SAMPLE_ID.
//   stdin  {"prompt": [chat messages], "metadata": {...}, "config": {...}}
//   stdout the last line, when it is a JSON object with "messages", becomes
//          the sample's messages (framework-native); otherwise the proxy's
//          recording of the conversation does.
//   stderr goes to the rollout's log; a non-zero exit is an agent error.
//
// Nothing here is specific to a test: pointed at any OpenAI-compatible
// server through the same variables, the agents behave the same.

/** One OpenAI chat message as it arrives in the prompt. */
export interface ChatMessage {
  role: string;
  content?: string | Array<{ type?: string; text?: string }> | null;
  [key: string]: unknown;
}

/** What the runner writes on stdin. */
export interface SampleInput {
  prompt: ChatMessage[];
  metadata: Record<string, unknown>;
  config: Record<string, unknown>;
}

/** The connection to the policy, from the environment. */
export interface PolicyEndpoint {
  baseURL: string;
  apiKey: string;
  rolloutID: string;
  sampleID: string;
}

/** The model id agents send; the proxy routes it to the current policy. */
export const PLACEHOLDER_MODEL = 'openai/osmosis-rollout';

/** The most stdin this program reads, so a runaway writer cannot exhaust memory. */
const MAX_INPUT_BYTES = 16 << 20;

/** A mistake in what the runner handed the agent; its message names the field. */
export class ContractError extends Error {
  override name = 'ContractError';
}

/** Reads the policy endpoint from the environment. */
export function policyEndpoint(env: NodeJS.ProcessEnv = process.env): PolicyEndpoint {
  const need = (name: string): string => {
    const v = env[name];
    if (!v) throw new ContractError(`environment variable ${name} is not set`);
    return v;
  };
  const baseURL = env.OPENAI_BASE_URL || env.OSMOSIS_CHAT_COMPLETIONS_URL;
  if (!baseURL) {
    throw new ContractError('environment variable OPENAI_BASE_URL (or OSMOSIS_CHAT_COMPLETIONS_URL) is not set');
  }
  return {
    baseURL,
    apiKey: need('OPENAI_API_KEY'),
    rolloutID: env.OSMOSIS_ROLLOUT_ID ?? '',
    sampleID: env.OSMOSIS_SAMPLE_ID ?? '',
  };
}

/** Reads and validates the sample from stdin. */
export async function readSampleInput(stream: NodeJS.ReadableStream = process.stdin): Promise<SampleInput> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of stream) {
    const b = typeof chunk === 'string' ? Buffer.from(chunk) : (chunk as Buffer);
    size += b.length;
    if (size > MAX_INPUT_BYTES) throw new ContractError(`stdin: input exceeds ${MAX_INPUT_BYTES} bytes`);
    chunks.push(b);
  }
  return parseSampleInput(Buffer.concat(chunks).toString('utf8'));
}

/** Validates the stdin document. */
export function parseSampleInput(text: string): SampleInput {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (err) {
    throw new ContractError(`stdin: not a JSON object: ${(err as Error).message}`);
  }
  if (!isObject(doc)) throw new ContractError('stdin: not a JSON object');
  // Absent or null: none given.
  const { prompt } = doc;
  const metadata = doc.metadata ?? {};
  const config = doc.config ?? {};
  if (!Array.isArray(prompt) || prompt.length === 0) {
    throw new ContractError('stdin: "prompt" must be a non-empty array of chat messages');
  }
  prompt.forEach((m, i) => {
    if (!isObject(m) || typeof m.role !== 'string') {
      throw new ContractError(`stdin: "prompt[${i}].role" must be a string`);
    }
    const c = m.content;
    if (c !== undefined && c !== null && typeof c !== 'string' && !Array.isArray(c)) {
      throw new ContractError(`stdin: "prompt[${i}].content" must be a string or an array of parts`);
    }
  });
  if (!isObject(metadata)) throw new ContractError('stdin: "metadata" must be an object');
  if (!isObject(config)) throw new ContractError('stdin: "config" must be an object');
  return { prompt: prompt as ChatMessage[], metadata, config };
}

/** The text of a chat message's content: a string or the text of its parts. */
export function contentText(content: ChatMessage['content']): string {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return '';
  return content
    .map((p) => (typeof p?.text === 'string' ? p.text : ''))
    .filter((s) => s !== '')
    .join('\n');
}

/** A number from the sample config, or def when it is absent. */
export function configNumber(config: Record<string, unknown>, key: string, def: number): number {
  const v = config[key];
  if (v === undefined || v === null) return def;
  if (typeof v !== 'number' || !Number.isFinite(v)) {
    throw new ContractError(`stdin: "config.${key}" must be a number`);
  }
  return v;
}

/**
 * Prints the sample's messages as the last stdout line. Logs must go to
 * stderr (console.error) so that this line stays last.
 */
export function emitMessages(messages: unknown[]): void {
  process.stdout.write(JSON.stringify({ messages }) + '\n');
}

/**
 * Runs an agent program: any error is reported on stderr with the cause
 * chain and turns into exit status 1.
 */
export function runMain(name: string, body: () => Promise<void>): void {
  body().then(
    () => {
      process.exitCode = 0;
    },
    (err: unknown) => {
      process.stderr.write(`${name}: ${describe(err)}\n`);
      process.exitCode = 1;
    },
  );
}

/** An error's message followed by its causes, so the root failure is named. */
export function describe(err: unknown): string {
  const parts: string[] = [];
  let said = '';
  for (let e: unknown = err, depth = 0; e !== undefined && e !== null && depth < 8; depth++) {
    if (e instanceof Error) {
      // SDK errors often keep the generic name "Error"; their class says more.
      const name = e.name !== 'Error' ? e.name : e.constructor?.name || e.name;
      const status = (e as { status?: unknown }).status;
      const head = `${name}${typeof status === 'number' ? ` (HTTP ${status})` : ''}`;
      // Wrappers often repeat their cause's message; say it once.
      parts.push(e.message && !said.includes(e.message) ? `${head}: ${e.message}` : head);
      said += e.message;
      e = e.cause;
    } else {
      parts.push(String(e));
      break;
    }
  }
  return parts.join(': caused by ');
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}
