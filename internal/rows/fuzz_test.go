package rows

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/osmo-rl/osmo"
)

// fuzzTexts is a tiny vocabulary: token id i has text fuzzTexts[i], tags
// and whitespace included so that every drift class can come up.
var fuzzTexts = []string{"<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "\n\n", " ", "a", "b", "{", "}", ":",
	"<|im_end|>", "<|im_start|>", "x", "y"}

const fuzzEnd = 12 // <|im_end|>

// byteReader hands out the fuzz input's bytes, then zeros.
type byteReader struct{ data []byte }

func (r *byteReader) next() int {
	if len(r.data) == 0 {
		return 0
	}
	b := r.data[0]
	r.data = r.data[1:]
	return int(b)
}

func (r *byteReader) tokens(n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(r.next() % len(fuzzTexts))
	}
	return out
}

// fuzzCalls turns bytes into a sample's calls: mostly prompts that extend
// the previous call's prompt and completion, some that part from it
// (a token changed, dropped or added), fresh ones, and broken ones.
func fuzzCalls(data []byte) []*osmo.LLMCall {
	r := &byteReader{data: data}
	n := 1 + r.next()%8
	calls := make([]*osmo.LLMCall, 0, n)
	var prev []int32 // the previous call's prompt and completion
	for range n {
		op := r.next() % 10
		var p []int32
		switch {
		case prev != nil && op < 5:
			p = slices.Concat(prev, r.tokens(r.next()%6))
		case prev != nil && op < 8:
			p = slices.Clone(prev)
			at := r.next() % len(p)
			switch r.next() % 3 {
			case 0:
				p[at] = int32(r.next() % len(fuzzTexts))
			case 1:
				p = slices.Delete(p, at, min(len(p), at+1+r.next()%3))
			default:
				p = slices.Insert(p, at, r.tokens(1+r.next()%3)...)
			}
			p = append(p, r.tokens(r.next()%6)...)
		default:
			p = r.tokens(1 + r.next()%8)
		}
		comp := r.tokens(1 + r.next()%6)
		if r.next()%2 == 0 {
			comp = append(comp, fuzzEnd)
		}
		c := &osmo.LLMCall{PromptTokenIDs: p, CompletionTokenIDs: comp, Logprobs: make([]float64, len(comp))}
		for i := range c.Logprobs {
			c.Logprobs[i] = -float64(r.next()) / 16
		}
		if r.next()%4 != 0 {
			for _, id := range comp {
				c.CompletionTokenStrings = append(c.CompletionTokenStrings, fuzzTexts[id])
			}
		}
		// The parsed reply, naming some of the completion's text as the
		// reasoning or a tool call.
		switch r.next() % 4 {
		case 0:
			c.ResponseMessage, _ = json.Marshal(map[string]any{"reasoning_content": fuzzTexts[r.next()%len(fuzzTexts)] + fuzzTexts[r.next()%len(fuzzTexts)]})
		case 1:
			c.ResponseMessage, _ = json.Marshal(map[string]any{"tool_calls": []any{map[string]any{"function": map[string]any{"name": fuzzTexts[r.next()%len(fuzzTexts)]}}}})
		case 2:
			c.ResponseMessage = json.RawMessage(`{"content": 3`)
		}
		switch r.next() % 16 {
		case 0:
			c.PromptTokenIDs = nil
		case 1:
			c.CompletionTokenIDs = nil
		case 2:
			c.Logprobs = c.Logprobs[1:]
		case 3:
			c.Error = "stream cut"
		case 4:
			c.CompletionTokenIDs[0] = int32(len(fuzzTexts)) // outside the vocabulary
		case 5:
			if len(c.PromptTokenIDs) > 0 {
				c.PromptTokenIDs[len(c.PromptTokenIDs)-1] = -1
			}
		case 6:
			c.CompletionTokenStrings = c.CompletionTokenStrings[:len(c.CompletionTokenStrings)/2]
		}
		calls = append(calls, c)
		prev = slices.Concat(c.PromptTokenIDs, c.CompletionTokenIDs)
		if len(prev) == 0 {
			prev = nil
		}
	}
	return calls
}

func FuzzBuild(f *testing.F) {
	f.Add([]byte{}, false)
	f.Add([]byte{4, 0, 3, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 9, 0, 2, 7, 8, 0, 1, 1, 1, 0, 9}, false)
	f.Add([]byte{6, 6, 5, 12, 0, 4, 5, 6, 7, 8, 1, 2, 2, 3, 1, 0, 1, 5, 0, 1, 0, 0, 0, 1, 0, 1, 2, 6, 8, 9, 5, 7, 7}, true)
	f.Add([]byte{3, 9, 4, 0, 1, 2, 3, 5, 4, 6, 8, 0, 1, 4, 7, 7, 7, 7, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, true)
	f.Fuzz(func(t *testing.T, data []byte, realign bool) {
		calls := fuzzCalls(data)
		o := Options{VocabSize: len(fuzzTexts)}
		if realign {
			o.Merge = ModeRealign
		}
		res := Build(Sample{RolloutID: "r", SampleID: "s", Calls: calls}, o)
		checkInvariants(t, calls, o, res)

		// Counting only gives the same rows without their tokens.
		o.CountOnly = true
		counted := Build(Sample{RolloutID: "r", SampleID: "s", Calls: calls}, o)
		if len(counted.Rows) != len(res.Rows) || !slices.Equal(counted.Problems, res.Problems) {
			t.Fatalf("count only:\n%s\nfull:\n%s", describeAll(counted), describeAll(res))
		}
		for i, r := range counted.Rows {
			full := res.Rows[i]
			if r.TokenIDs != nil || r.LossMask != nil || r.Logprobs != nil || r.Merge != full.Merge ||
				!slices.Equal(r.Calls, full.Calls) || !slices.Equal(r.Drift, full.Drift) || !slices.Equal(r.Problems, full.Problems) {
				t.Fatalf("count only row %s, full %s", describe(r), describe(full))
			}
		}
	})
}

// checkInvariants fails t unless res holds what the package doc promises
// of calls' rows.
func checkInvariants(t *testing.T, calls []*osmo.LLMCall, o Options, res Result) {
	t.Helper()
	exact := o.Merge != ModeRealign
	where := make([]string, len(calls)) // "row" or "problem" per call
	for _, p := range res.Problems {
		if p.Call < 0 || p.Call >= len(calls) || where[p.Call] != "" || p.Reason == "" {
			t.Fatalf("bad problem %+v\n%s", p, describeAll(res))
		}
		where[p.Call] = "problem"
	}
	for ri, r := range res.Rows {
		if r.Row != ri || len(r.TokenIDs) != len(r.LossMask) || len(r.TokenIDs) != len(r.Logprobs) || len(r.Calls) == 0 {
			t.Fatalf("row %d: %s", ri, describe(r))
		}
		if _, err := json.Marshal(r); err != nil {
			t.Fatalf("row %d: %v", ri, err)
		}
		switch {
		case ri == 0 && len(r.Problems) == 0 && r.Merge != MergeExact && r.Merge != MergeRealigned:
			t.Fatalf("first row not exact: %s", describe(r))
		case (ri > 0 || len(r.Problems) > 0) && r.Merge == MergeExact:
			t.Fatalf("row after a break or problem is exact: %s", describe(r))
		case exact && r.Merge == MergeRealigned:
			t.Fatalf("realigned in exact mode: %s", describe(r))
		case exact && ri > 0 && len(r.Problems) == 0 && (len(r.Drift) != 1 || r.Drift[0].Call != r.Calls[0]):
			t.Fatalf("forked row without its drift: %s", describe(r))
		}
		for _, p := range r.Problems {
			if !slices.Contains(res.Problems, p) || p.Call >= r.Calls[0] {
				t.Fatalf("row %d problem %+v not in the summary or not before it", ri, p)
			}
		}
		for _, d := range r.Drift {
			if !slices.Contains(r.Calls, d.Call) || d.Call == 0 {
				t.Fatalf("row %d: drift %+v of a call not in it", ri, d)
			}
			prev := calls[d.Call-1]
			if d.Position < 0 || d.Position >= len(prev.PromptTokenIDs)+len(prev.CompletionTokenIDs) {
				t.Fatalf("row %d: drift %+v outside the previous sequence", ri, d)
			}
			switch d.Class {
			case DriftReasoningDropped, DriftToolCallReserialized, DriftWhitespace, DriftOther:
			default:
				t.Fatalf("row %d: drift class %q", ri, d.Class)
			}
		}

		// The row is the first call's prompt and completion, then each
		// later call's prompt suffix (mask 0) and completion (mask 1).
		pos := 0
		for k, ci := range r.Calls {
			if ci < 0 || ci >= len(calls) || where[ci] != "" || (k > 0 && ci <= r.Calls[k-1]) {
				t.Fatalf("row %d: call %d out of order or twice", ri, ci)
			}
			where[ci] = "row"
			c := calls[ci]
			ctx := 0
			for pos+ctx < len(r.LossMask) && r.LossMask[pos+ctx] == 0 {
				ctx++
			}
			if k == 0 && ctx != len(c.PromptTokenIDs) {
				t.Fatalf("row %d: starts with %d context tokens, want the prompt's %d", ri, ctx, len(c.PromptTokenIDs))
			}
			if ctx > len(c.PromptTokenIDs) || !slices.Equal(r.TokenIDs[pos:pos+ctx], c.PromptTokenIDs[len(c.PromptTokenIDs)-ctx:]) {
				t.Fatalf("row %d: context before call %d is not its prompt's end", ri, ci)
			}
			if exact && k > 0 {
				prev := calls[r.Calls[k-1]]
				head := slices.Concat(prev.PromptTokenIDs, prev.CompletionTokenIDs)
				if len(head)+ctx != len(c.PromptTokenIDs) || !slices.Equal(c.PromptTokenIDs[:len(head)], head) {
					t.Fatalf("row %d: call %d merged without extending call %d", ri, ci, r.Calls[k-1])
				}
			}
			for j := range pos + ctx {
				if r.LossMask[j] == 0 && r.Logprobs[j] != 0 {
					t.Fatalf("row %d: logprob on a context token at %d", ri, j)
				}
			}
			pos += ctx
			end := pos + len(c.CompletionTokenIDs)
			if end > len(r.TokenIDs) || !slices.Equal(r.TokenIDs[pos:end], c.CompletionTokenIDs) ||
				!slices.Equal(r.Logprobs[pos:end], c.Logprobs) || slices.Contains(r.LossMask[pos:end], 0) {
				t.Fatalf("row %d: call %d's completion not at %d", ri, ci, pos)
			}
			pos = end
		}
		if pos != len(r.TokenIDs) {
			t.Fatalf("row %d: %d tokens after its last completion", ri, len(r.TokenIDs)-pos)
		}
		if last := calls[r.Calls[len(r.Calls)-1]]; exact && !slices.Equal(r.TokenIDs, slices.Concat(last.PromptTokenIDs, last.CompletionTokenIDs)) {
			t.Fatalf("row %d is not its last call's prompt and completion", ri)
		}
	}
	for i, w := range where {
		if w == "" {
			t.Fatalf("call %d is in no row and no problem\n%s", i, describeAll(res))
		}
	}
}
