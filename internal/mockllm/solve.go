package mockllm

import (
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"math"
	"strconv"
	"strings"
)

// noTaskAnswer is the reply when the last user message holds no arithmetic.
const noTaskAnswer = "I'm sorry, I can only help with arithmetic. Please ask something like \"What is 12 * 7 + 3?\"."

// undefinedAnswer is the reply when the arithmetic divides by zero.
const undefinedAnswer = "The expression is undefined (it divides by zero)."

// maxDepth bounds parentheses and unary minus nesting so a hostile prompt
// cannot exhaust the stack.
const maxDepth = 64

// step is one binary operation of an expression; operands refer to
// literals or to the results of earlier steps.
type step struct {
	op   byte
	a, b operand
}

type operand struct {
	ref int // index of an earlier step, or -1 for a literal
	num float64
}

// parseExpr parses arithmetic with Go's expression parser, whose
// precedence is arithmetic's, taking only numbers, + - * /, unary minus
// and parentheses. It returns the operations in evaluation order (left
// operand first).
func parseExpr(s string) ([]step, error) {
	node, err := parser.ParseExpr(s)
	if err != nil {
		return nil, err
	}
	var steps []step
	_, err = addSteps(node, 0, &steps)
	return steps, err
}

// addSteps appends node's operations to steps and returns its value.
func addSteps(node ast.Expr, depth int, steps *[]step) (operand, error) {
	if depth > maxDepth {
		return operand{}, errors.New("expression nested too deeply")
	}
	switch n := node.(type) {
	case *ast.ParenExpr:
		return addSteps(n.X, depth+1, steps)
	case *ast.BasicLit:
		v, err := strconv.ParseFloat(n.Value, 64)
		if err != nil {
			return operand{}, fmt.Errorf("bad number %q", n.Value)
		}
		return operand{ref: -1, num: v}, nil
	case *ast.UnaryExpr:
		if n.Op != token.SUB {
			break
		}
		v, err := addSteps(n.X, depth+1, steps)
		if err != nil || v.ref < 0 {
			v.num = -v.num
			return v, err
		}
		*steps = append(*steps, step{op: '-', a: operand{ref: -1}, b: v})
		return operand{ref: len(*steps) - 1}, nil
	case *ast.BinaryExpr:
		op := n.Op.String()
		if len(op) != 1 || !strings.Contains("+-*/", op) {
			break
		}
		a, err := addSteps(n.X, depth, steps)
		if err != nil {
			return a, err
		}
		b, err := addSteps(n.Y, depth, steps)
		if err != nil {
			return b, err
		}
		*steps = append(*steps, step{op: op[0], a: a, b: b})
		return operand{ref: len(*steps) - 1}, nil
	}
	return operand{}, errors.New("not arithmetic")
}

var wordOps = strings.NewReplacer(
	" multiplied by ", " * ", " times ", " * ", " plus ", " + ", " minus ", " - ",
	" divided by ", " / ", "×", "*", "÷", "/",
)

// findExpression returns the first arithmetic expression with at least one
// operator in text, and its source with spaces normalized.
func findExpression(text string) ([]step, string, bool) {
	text = wordOps.Replace(strings.ToLower(text))
	isExprByte := func(c byte) bool { return c >= '0' && c <= '9' || strings.IndexByte(".+-*/() ", c) >= 0 }
	for i := 0; i < len(text); {
		if !isExprByte(text[i]) {
			i++
			continue
		}
		j := i
		for j < len(text) && isExprByte(text[j]) {
			j++
		}
		src := strings.Join(strings.Fields(strings.TrimRight(text[i:j], ". ")), " ")
		i = j
		if steps, err := parseExpr(src); err == nil && len(steps) > 0 {
			return steps, src, true
		}
	}
	return nil, "", false
}

func apply(op byte, a, b float64) float64 {
	switch op {
	case '+':
		return a + b
	case '-':
		return a - b
	case '*':
		return a * b
	}
	return a / b
}

// toolset is what the request's tools let the mock call.
type toolset struct {
	binary     map[byte]string // operator -> tool taking numbers a and b
	calculator string          // tool taking a whole expression
	exprParam  string          // its string parameter
}

var binaryTools = map[string]byte{"add": '+', "subtract": '-', "multiply": '*', "divide": '/'}

func toolsetOf(tools []map[string]any) toolset {
	ts := toolset{binary: map[byte]string{}}
	for _, t := range tools {
		fn, _ := t["function"].(map[string]any)
		name, _ := fn["name"].(string)
		params, _ := fn["parameters"].(map[string]any)
		props, _ := params["properties"].(map[string]any)
		if op, ok := binaryTools[name]; ok && props["a"] != nil && props["b"] != nil {
			ts.binary[op] = name
			continue
		}
		exprProp, _ := props["expression"].(map[string]any)
		switch {
		case len(props) == 1 && exprProp != nil && exprProp["type"] == "string":
			ts.calculator, ts.exprParam = name, "expression"
		case name == "calculator" && ts.calculator == "":
			ts.calculator, ts.exprParam = name, "expression"
			if len(props) == 1 {
				for k := range props { // whatever its single parameter is called
					ts.exprParam = k
				}
			}
		}
	}
	return ts
}

// decision is the model's next move: a tool call or a final text.
type decision struct {
	tool, args string
	text       string
	answer     string // the number in text, when there is one
}

// decide plays one assistant turn for task, given the tool results that
// followed it. Operations with a tool are called one per turn; the others
// are computed inline, as a model would do in its head.
func decide(task string, results []string, ts toolset) decision {
	steps, src, ok := findExpression(task)
	if !ok {
		return decision{text: noTaskAnswer}
	}
	vals := make([]float64, len(steps))
	val := func(o operand) float64 {
		if o.ref < 0 {
			return o.num
		}
		return vals[o.ref]
	}
	usesBinary := false
	for _, s := range steps {
		usesBinary = usesBinary || ts.binary[s.op] != ""
	}
	if !usesBinary && ts.calculator != "" && len(results) == 0 {
		args, _ := json.Marshal(map[string]string{ts.exprParam: src})
		return decision{tool: ts.calculator, args: string(args)}
	}
	next := 0
	for i, s := range steps {
		a, b := val(s.a), val(s.b)
		if math.IsInf(a, 0) || math.IsNaN(a) || math.IsInf(b, 0) || math.IsNaN(b) {
			return decision{text: undefinedAnswer}
		}
		vals[i] = apply(s.op, a, b)
		name := ts.binary[s.op]
		if name == "" {
			continue
		}
		if next >= len(results) {
			return decision{tool: name, args: fmt.Sprintf(`{"a":%s,"b":%s}`, jsonNumber(a), jsonNumber(b))}
		}
		// Trust the tool: a real model reads the result it was given.
		if v, ok := parseResult(results[next]); ok {
			vals[i] = v
		}
		next++
	}
	answer := vals[len(vals)-1]
	if !usesBinary && ts.calculator != "" {
		if v, ok := parseResult(results[0]); ok {
			answer = v
		}
	}
	if math.IsInf(answer, 0) || math.IsNaN(answer) {
		return decision{text: undefinedAnswer}
	}
	v := formatNumber(answer)
	return decision{text: "The answer is " + v + ".\n#### " + v, answer: v}
}

// parseResult reads a number from a tool result: plain text, or a JSON
// object with a "result" or "value" field.
func parseResult(s string) (float64, bool) {
	s = strings.TrimSpace(s)
	if v, err := strconv.ParseFloat(s, 64); err == nil {
		return v, true
	}
	var obj map[string]any
	if json.Unmarshal([]byte(s), &obj) == nil {
		for _, k := range []string{"result", "value"} {
			if v, ok := obj[k].(float64); ok {
				return v, true
			}
		}
	}
	return 0, false
}

// jsonNumber renders v as a JSON number, integers without a fraction.
func jsonNumber(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// formatNumber renders an answer the way the mock writes it: an integer when
// integral, else at most 6 decimals with trailing zeros trimmed.
func formatNumber(v float64) string {
	s := strconv.FormatFloat(v, 'f', 6, 64)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	if s == "-0" {
		return "0"
	}
	return s
}

// conversation returns the task (the text of the last user message) and the
// tool results that came after it, in order. It understands OpenAI chat
// messages, OpenAI Agents items and Strands content blocks.
func conversation(msgs []map[string]any) (task string, results []string) {
	last := -1
	for i := len(msgs) - 1; i >= 0 && last < 0; i-- {
		if msgs[i]["role"] == "user" {
			if t := text(msgs[i]["content"]); t != "" {
				last, task = i, t
			}
		}
	}
	for _, m := range msgs[last+1:] {
		switch {
		case m["role"] == "tool":
			results = append(results, text(m["content"]))
		case m["type"] == "function_call_output":
			results = append(results, text(m["output"]))
		default:
			blocks, _ := m["content"].([]any)
			for _, b := range blocks {
				bm, _ := b.(map[string]any)
				if tr, ok := bm["toolResult"].(map[string]any); ok {
					results = append(results, text(tr["content"]))
				}
			}
		}
	}
	return task, results
}

// text flattens content: a string, or a list of parts carrying "text"
// (chat, Agents input_text/output_text, Strands) or Strands {"json": v}.
func text(content any) string {
	switch c := content.(type) {
	case string:
		return c
	case []any:
		var parts []string
		for _, p := range c {
			pm, _ := p.(map[string]any)
			if s, ok := pm["text"].(string); ok {
				parts = append(parts, s)
			} else if v, ok := pm["json"]; ok {
				b, _ := json.Marshal(v)
				parts = append(parts, string(b))
			}
		}
		return strings.Join(parts, "\n")
	}
	return ""
}
