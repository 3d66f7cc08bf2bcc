// A small arithmetic evaluator for the calculator tool. Model output is
// untrusted input, so expressions are parsed, never passed to eval: only
// numbers, + - * / %, unary minus and parentheses are understood.

/** An expression the evaluator cannot accept; the message says where. */
export class ArithmeticError extends Error {
  override name = 'ArithmeticError';
}

/** Bounds that keep hostile input cheap to reject. */
export const MAX_EXPRESSION_LENGTH = 1000;
const MAX_DEPTH = 64;

/** Evaluates expression, e.g. "(2 + 3) * 4" -> 20. */
export function evaluate(expression: string): number {
  if (expression.length > MAX_EXPRESSION_LENGTH) {
    throw new ArithmeticError(`expression longer than ${MAX_EXPRESSION_LENGTH} characters`);
  }
  const p = new Parser(expression);
  const v = p.sum();
  p.skipSpace();
  if (!p.done()) p.fail('unexpected');
  if (!Number.isFinite(v)) throw new ArithmeticError('result is not a finite number (division by zero?)');
  return v;
}

/** Formats a result as the tool returns it: integers without a fraction. */
export function formatResult(v: number): string {
  return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(12)));
}

class Parser {
  private i = 0;
  private depth = 0;

  constructor(private readonly s: string) {}

  done(): boolean {
    return this.i >= this.s.length;
  }

  skipSpace(): void {
    while (!this.done() && /\s/.test(this.s[this.i]!)) this.i++;
  }

  fail(what: string): never {
    const at = this.done() ? 'end of expression' : `${JSON.stringify(this.s[this.i])} at offset ${this.i}`;
    throw new ArithmeticError(`${what} ${at}`);
  }

  // sum := product (('+' | '-') product)*
  sum(): number {
    let v = this.product();
    for (;;) {
      this.skipSpace();
      const c = this.s[this.i];
      if (c !== '+' && c !== '-') return v;
      this.i++;
      const r = this.product();
      v = c === '+' ? v + r : v - r;
    }
  }

  // product := factor (('*' | '/' | '%') factor)*
  product(): number {
    let v = this.factor();
    for (;;) {
      this.skipSpace();
      const c = this.s[this.i];
      if (c !== '*' && c !== '/' && c !== '%') return v;
      this.i++;
      const r = this.factor();
      v = c === '*' ? v * r : c === '/' ? v / r : v % r;
    }
  }

  // factor := '-' factor | '+' factor | '(' sum ')' | number
  factor(): number {
    if (++this.depth > MAX_DEPTH) throw new ArithmeticError('expression nested too deeply');
    try {
      this.skipSpace();
      const c = this.s[this.i];
      if (c === '-' || c === '+') {
        this.i++;
        const v = this.factor();
        return c === '-' ? -v : v;
      }
      if (c === '(') {
        this.i++;
        const v = this.sum();
        this.skipSpace();
        if (this.s[this.i] !== ')') this.fail('expected ) but found');
        this.i++;
        return v;
      }
      const m = /^(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?/.exec(this.s.slice(this.i));
      if (!m) this.fail('expected a number but found');
      this.i += m[0].length;
      return Number(m[0]);
    } finally {
      this.depth--;
    }
  }
}
