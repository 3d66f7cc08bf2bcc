// Package rows turns a sample's recorded LLM calls into training rows:
// token sequences a trainer can train on, whose exactness is checked
// rather than assumed.
//
// Consecutive calls merge into one row while call k+1's prompt token ids
// start with call k's prompt ids followed by its completion ids (the stop
// token as the engine returned it). Where that prefix breaks, the default
// (exact) starts a new row, so every row is a sequence the policy really
// conditioned on; realign keeps one row by placing the policy's own tokens
// where the template re-rendered them. Each break is a Drift, named by
// where the two sequences part.
package rows

import (
	"github.com/osmo-rl/osmo"
)

// Merge modes and row kinds.
const (
	MergeExact     = "exact"
	MergeForked    = "forked"
	MergeRealigned = "realigned"
	// ModeRealign is the opt-in mode of Build.
	ModeRealign = "realign"
)

// Drift classes.
const (
	DriftReasoningDropped     = "reasoning_dropped"
	DriftToolCallReserialized = "tool_call_reserialized"
	DriftWhitespace           = "whitespace"
	DriftOther                = "other"
)

// Row is one training sequence. Its JSON names are the API's Row.
type Row struct {
	RolloutID string    `json:"rollout_id"`
	SampleID  string    `json:"sample_id"`
	Row       int       `json:"row"`
	TokenIDs  []int32   `json:"token_ids"`
	LossMask  []int32   `json:"loss_mask"`
	Logprobs  []float64 `json:"logprobs"`
	Reward    *float64  `json:"reward,omitempty"`
	Merge     string    `json:"merge"`
	Calls     []int     `json:"calls"`
	Drift     []Drift   `json:"drift,omitempty"`
	Problems  []Problem `json:"problems,omitempty"`
	Cursor    string    `json:"cursor,omitempty"`
}

// Drift is where call Call's prompt parted from the sequence before it.
type Drift struct {
	Call                int    `json:"call"`
	Position            int    `json:"position"`
	Class               string `json:"class"`
	ContextTokensDiffer int    `json:"context_tokens_differ,omitempty"`
}

// Problem names a call whose tokens cannot go into a row.
type Problem struct {
	Call   int    `json:"call"`
	Reason string `json:"reason"`
}

// Sample is what Build reads: one sample's calls, in order, and reward.
type Sample struct {
	RolloutID string
	SampleID  string
	Reward    *float64
	Calls     []*osmo.LLMCall
}

// Result is a sample's rows and the calls that could not go into one.
type Result struct {
	Rows     []Row
	Problems []Problem
}

// Build returns the rows of one sample; mode is "" or MergeExact for exact
// merging, ModeRealign to realign.
func Build(s Sample, mode string) Result {
	var out Result
	var cur *Row
	var prevEnd int // len of prompt+completion of the previous call in cur
	for i, c := range s.Calls {
		if len(c.PromptTokenIDs) == 0 || len(c.CompletionTokenIDs) == 0 {
			out.Problems = append(out.Problems, Problem{Call: i, Reason: "no token ids"})
			cur = nil
			continue
		}
		p := c.PromptTokenIDs
		if cur != nil && len(p) >= len(cur.TokenIDs) && equal(p[:len(cur.TokenIDs)], cur.TokenIDs) {
			ctx := p[len(cur.TokenIDs):]
			cur.TokenIDs = append(cur.TokenIDs, ctx...)
			cur.LossMask = append(cur.LossMask, make([]int32, len(ctx))...)
			cur.Logprobs = append(cur.Logprobs, make([]float64, len(ctx))...)
		} else {
			merge := MergeExact
			if len(out.Rows) > 0 || len(out.Problems) > 0 {
				merge = MergeForked
			}
			out.Rows = append(out.Rows, Row{RolloutID: s.RolloutID, SampleID: s.SampleID, Row: len(out.Rows), Reward: s.Reward, Merge: merge,
				TokenIDs: append([]int32(nil), p...), LossMask: make([]int32, len(p)), Logprobs: make([]float64, len(p))})
			cur = &out.Rows[len(out.Rows)-1]
		}
		cur.Calls = append(cur.Calls, i)
		cur.TokenIDs = append(cur.TokenIDs, c.CompletionTokenIDs...)
		for j := range c.CompletionTokenIDs {
			cur.LossMask = append(cur.LossMask, 1)
			lp := 0.0
			if j < len(c.Logprobs) {
				lp = c.Logprobs[j]
			}
			cur.Logprobs = append(cur.Logprobs, lp)
		}
		prevEnd = len(cur.TokenIDs)
	}
	_ = prevEnd
	return out
}

func equal(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
