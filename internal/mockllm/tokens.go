package mockllm

import (
	"cmp"
	"hash/fnv"
	"math"
	"strings"
	"unicode"
)

// Special token ids framing each prompt message, as chat templates do.
const (
	tokMessageStart = 1
	tokMessageEnd   = 2
)

// tokenize splits s into pieces whose concatenation is s: runs of letters
// and digits, runs of one punctuation mark and whitespace runs, a single leading
// space joining the piece after it (" answer", " 42").
func tokenize(s string) []string {
	rs := []rune(s)
	var out []string
	for i := 0; i < len(rs); {
		start := i
		if rs[i] == ' ' && i+1 < len(rs) && !unicode.IsSpace(rs[i+1]) {
			i++
		}
		switch r := rs[i]; {
		case isWord(r):
			for i < len(rs) && isWord(rs[i]) {
				i++
			}
		case unicode.IsSpace(r):
			for i < len(rs) && unicode.IsSpace(rs[i]) {
				i++
			}
			// Leave a final space to lead the next word.
			if i < len(rs) && i-start > 1 && rs[i-1] == ' ' {
				i--
			}
		default: // a run of one punctuation mark ("####") is one token
			for i++; i < len(rs) && rs[i] == rs[i-1]; i++ {
			}
		}
		out = append(out, string(rs[start:i]))
	}
	return out
}

func isWord(r rune) bool { return unicode.IsLetter(r) || unicode.IsDigit(r) }

func fnv32a(s string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return h.Sum32()
}

func tokenIDs(pieces []string) []int {
	ids := make([]int, len(pieces))
	for i, p := range pieces {
		ids[i] = 100 + int(fnv32a(p)%50000)
	}
	return ids
}

// promptTokenIDs tokenizes a conversation: each message is framed by start
// and end tokens around its role, text and tool calls; tool names follow.
func promptTokenIDs(msgs []map[string]any, tools []map[string]any) []int {
	var ids []int
	for _, m := range msgs {
		role, _ := m["role"].(string)
		typ, _ := m["type"].(string)
		role = cmp.Or(role, typ)
		var sb strings.Builder
		sb.WriteString(text(m["content"]))
		sb.WriteString(text(m["output"]))
		calls, _ := m["tool_calls"].([]any)
		for _, c := range calls {
			cm, _ := c.(map[string]any)
			fn, _ := cm["function"].(map[string]any)
			name, _ := fn["name"].(string)
			args, _ := fn["arguments"].(string)
			sb.WriteString(name + args)
		}
		ids = append(ids, tokMessageStart)
		ids = append(ids, tokenIDs(tokenize(role))...)
		ids = append(ids, tokenIDs(tokenize(sb.String()))...)
		ids = append(ids, tokMessageEnd)
	}
	for _, t := range tools {
		fn, _ := t["function"].(map[string]any)
		name, _ := fn["name"].(string)
		ids = append(ids, tokenIDs(tokenize(name))...)
	}
	return ids
}

// logprob is one entry of choices[].logprobs.content.
type logprob struct {
	Token       string       `json:"token"`
	Logprob     float64      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []topLogprob `json:"top_logprobs"`
}

type topLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// alternatives are the runner-up tokens reported in top_logprobs.
// There are more than the 20 that top_logprobs may ask for, so they never repeat.
var alternatives = []string{" the", " a", ",", ".", " is", "\n", " of", "0", "1", " to", " and", ":",
	" in", " it", " that", " for", " on", " with", " as", " =", " +", " *"}

// logprobs gives each piece a deterministic negative logprob, the sampled
// token first among its top n alternatives.
func logprobs(pieces []string, n int) []logprob {
	out := make([]logprob, len(pieces))
	for i, p := range pieces {
		h := fnv32a(string(rune('A'+i%26)) + p)
		lp := -float64(h%25000+1) / 10000
		top := []topLogprob{}
		for j, k := 0, 0; j < n; k++ {
			tok := p
			if j > 0 {
				if tok = alternatives[(int(h)+k)%len(alternatives)]; tok == p {
					continue
				}
			}
			alt := math.Round((lp-1.5*float64(j))*1e4) / 1e4
			top = append(top, topLogprob{Token: tok, Logprob: alt, Bytes: byteInts(tok)})
			j++
		}
		out[i] = logprob{Token: p, Logprob: lp, Bytes: byteInts(p), TopLogprobs: top}
	}
	return out
}

func byteInts(s string) []int {
	b := make([]int, len(s))
	for i := 0; i < len(s); i++ {
		b[i] = int(s[i])
	}
	return b
}
