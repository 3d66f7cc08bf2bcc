import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { ArithmeticError, evaluate, formatResult, MAX_EXPRESSION_LENGTH } from './arithmetic.ts';

describe('evaluate', () => {
  const cases: Array<[string, number]> = [
    ['6 * 7', 42],
    ['2 + 3 * 4', 14],
    ['(2 + 3) * 4', 20],
    ['10 - 4 - 3', 3],
    ['8 / 2 / 2', 2],
    ['-3 * -(2 + 1)', 9],
    ['7 % 4', 3],
    ['1.5e2 + .5', 150.5],
    ['  12\t*\n7 + 3 ', 87],
  ];
  for (const [expr, want] of cases) {
    test(expr, () => assert.equal(evaluate(expr), want));
  }

  const rejected: Array<[string, RegExp]> = [
    ['', /expected a number but found end of expression/],
    ['6 *', /end of expression/],
    ['(1 + 2', /expected \) but found end/],
    ['1 + 2)', /unexpected "\)" at offset 5/],
    ['process.exit(1)', /expected a number but found "p" at offset 0/],
    ['2 ** 3', /expected a number but found "\*"/],
    ['1 / 0', /not a finite number/],
    ['('.repeat(100) + '1' + ')'.repeat(100), /nested too deeply/],
    ['1+'.repeat(MAX_EXPRESSION_LENGTH) + '1', /longer than/],
  ];
  for (const [expr, want] of rejected) {
    test(`rejects ${JSON.stringify(expr.slice(0, 20))}`, () => {
      assert.throws(() => evaluate(expr), (err: unknown) => err instanceof ArithmeticError && want.test(err.message));
    });
  }
});

test('formatResult', () => {
  assert.equal(formatResult(42), '42');
  assert.equal(formatResult(-0.5), '-0.5');
  assert.equal(formatResult(0.1 + 0.2), '0.3');
});
