package rows

import (
	"fmt"
	"slices"
	"strings"

	"github.com/osmo-rl/osmo"
)

// Qwen3's ids for its special tokens and a few common ones; other words
// get ids from qwen3.id, stable within a test.
var qwen3Specials = map[string]int32{
	"<|im_start|>":     151644,
	"<|im_end|>":       151645,
	"<tool_call>":      151657,
	"</tool_call>":     151658,
	"<tool_response>":  151665,
	"</tool_response>": 151666,
	"<think>":          151667,
	"</think>":         151668,
	"\n":               198,
	"\n\n":             271,
	"\n\n\n":           1406,
	" ":                220,
	"user":             872,
	"assistant":        77091,
	"system":           8948,
	"{\"":              4913,
	"\":":              788,
	" \"":              330,
	",":                11,
	"}":                92,
	"}}":               3417,
	"name":             606,
	"arguments":        14799,
	"multiply":         64648,
	"a":                64,
	"b":                65,
	"3":                18,
	"4":                19,
	"12":               717,
	",\"":              1335,
	"The":              785,
	" answer":          4226,
	" is":              374,
	".":                13,
	"Let":              10061,
	" me":              752,
	" multiply":        30270,
	"What":             3838,
	" *":               353,
	"?":                30,
	"You":              2610,
	" are":             525,
	" helpful":         10950,
	"Hello":            9707,
	" there":           1052,
	"Hi":               13048,
	"<|endoftext|>":    151643,
}

// qwen3 turns token texts into ids as Qwen3's tokenizer would have
// produced them, and back.
type qwen3 struct{}

func (qwen3) id(t string) int32 {
	if id, ok := qwen3Specials[t]; ok {
		return id
	}
	// Words not listed get a stable id in a range the listed ones leave
	// free, below the special tokens.
	var h uint32 = 2166136261
	for i := 0; i < len(t); i++ {
		h = (h ^ uint32(t[i])) * 16777619
	}
	return 100000 + int32(h%50000)
}

func (q qwen3) ids(texts []string) []int32 {
	out := make([]int32, len(texts))
	for i, t := range texts {
		out[i] = q.id(t)
	}
	return out
}

// Pieces of conversations, as token texts.
var (
	systemUser = []string{"<|im_start|>", "system", "\n", "You", " are", " helpful", ".", "<|im_end|>", "\n",
		"<|im_start|>", "user", "\n", "What", " is", " ", "3", " *", " ", "4", "?", "<|im_end|>", "\n",
		"<|im_start|>", "assistant", "\n"}
	thinkOff = []string{"<think>", "\n\n", "</think>", "\n\n"}
	// A tool call as the policy generated it, compact, and as the
	// template re-renders its parsed arguments.
	toolCallCompact = []string{"<tool_call>", "\n", "{\"", "name", "\":", " \"", "multiply", "\",", " \"",
		"arguments", "\":", " {\"", "a", "\":", "3", ",\"", "b", "\":", "4", "}}", "\n", "</tool_call>"}
	toolCallSpaced = []string{"<tool_call>", "\n", "{\"", "name", "\":", " \"", "multiply", "\",", " \"",
		"arguments", "\":", " {\"", "a", "\":", " ", "3", ",", " \"", "b", "\":", " ", "4", "}}", "\n", "</tool_call>"}
	reasoning    = []string{"<think>", "\n", "Let", " me", " multiply", ".", "\n", "</think>", "\n\n"}
	toolResponse = []string{"\n", "<|im_start|>", "user", "\n", "<tool_response>", "\n", "12", "\n", "</tool_response>", "<|im_end|>", "\n",
		"<|im_start|>", "assistant", "\n"}
	answer = []string{"The", " answer", " is", " ", "12", ".", "<|im_end|>"}
)

func cat(parts ...[]string) []string { return slices.Concat(parts...) }

// call is a recorded call whose prompt and completion are the given
// token texts, with logprobs -0.5, -1.5, … so that their placement shows.
func call(prompt, completion []string) *osmo.LLMCall {
	var q qwen3
	lp := make([]float64, len(completion))
	for i := range lp {
		lp[i] = -0.5 - float64(i)
	}
	return &osmo.LLMCall{
		PromptTokenIDs:         q.ids(prompt),
		CompletionTokenIDs:     q.ids(completion),
		Logprobs:               lp,
		CompletionTokenStrings: slices.Clone(completion),
	}
}

// describe renders a row for a failure message.
func describe(r Row) string {
	return fmt.Sprintf("row %d %s calls=%v drift=%+v problems=%+v len=%d", r.Row, r.Merge, r.Calls, r.Drift, r.Problems, len(r.TokenIDs))
}

func describeAll(res Result) string {
	var sb strings.Builder
	for _, r := range res.Rows {
		sb.WriteString(describe(r) + "\n")
	}
	fmt.Fprintf(&sb, "problems=%+v", res.Problems)
	return sb.String()
}
