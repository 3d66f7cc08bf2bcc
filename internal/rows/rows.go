// Package rows turns a sample's recorded LLM calls into training rows:
// token sequences a trainer can train on, whose exactness is checked
// rather than assumed.
//
// # Merging
//
// Consecutive calls merge into one row while call k+1's prompt token ids
// start with call k's prompt ids followed by its completion ids (the stop
// token as the engine returned it). A row is the first call's prompt (loss
// mask 0) and completion (mask 1), then, for each later call, the tokens
// its prompt adds after that prefix (mask 0) and its completion (mask 1);
// logprobs are the policy's on completion tokens and 0 elsewhere, and the
// three arrays always have the same length. In exact mode (the default)
// a row therefore equals its last call's prompt followed by its
// completion: every row is a sequence the policy really conditioned on.
//
// Where the prefix breaks, exact mode starts a new row ("forked"). Realign
// mode (opt-in) instead keeps one row ("realigned"): it finds where the
// re-rendered turn ends in the new prompt (the n-th occurrence, counted
// from the break, of the token the previous completion ended with, which
// must end that completion only, like a stop token) and continues the row
// with the policy's own tokens followed by the new prompt after that
// point; Drift.ContextTokensDiffer counts the re-rendered tokens the
// policy's tokens stand in for. When it cannot find the point, it forks.
//
// # Drift
//
// Each break is a Drift: the call whose prompt parted, the position (an
// index into the previous call's prompt followed by its completion) where
// the two sequences part, and a class named from what surrounds that
// position. The text of the previous completion comes from its token
// strings (vLLM's logprobs.content[].token); the text of prompt tokens is
// known where the same ids appear in the sample's completions. Tags are
// matched as text, so the rules hold for any tokenizer:
//
//   - reasoning_dropped: the position is inside, or at the start of, a
//     <think>…</think> region, or on whitespace that leads into one when
//     the sequences do not resynchronise after it (the tokenizer merged
//     the whitespace around the dropped region); or it is in the previous
//     prompt's tail and
//     the new prompt leaves out the rest of that prompt (up to where the
//     completion starts, which follows unchanged) whose visible text is a
//     think tag or whitespace: the generation prompt's think block (Qwen3
//     with thinking off, DeepSeek-R1), which templates do not re-render.
//   - tool_call_reserialized: inside a <tool_call>…</tool_call> region.
//   - A completion without those tags is read with the message its reply
//     was parsed into (LLMCall.ResponseMessage): a position before the end
//     of the reasoning's text (reasoning_content or reasoning) is
//     reasoning_dropped; one at or after the start of the line where the
//     first tool call's function name appears is tool_call_reserialized.
//   - whitespace: the two sequences resynchronise after skipping a few
//     tokens, and every skipped token whose text is known, on either side,
//     is whitespace.
//   - other: anything else, including a completion without token strings.
//
// # Problems
//
// A call whose tokens cannot go into a row is a Problem, never a silently
// shorter row: no prompt or completion ids (with the recorded reason), ids
// and logprobs of different lengths, no logprobs, a logprob that is not
// one (NaN, infinite, positive), a negative id or one outside a known
// vocabulary, or a failed call (an error recorded, a stream cut). It is
// listed in Result.Problems and on the row that follows it, which is
// "forked"; the rest of the sample still yields rows.
package rows

import (
	"fmt"
	"math"
	"slices"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/fielderr"
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
	// Versions are the row's completion segments, in order, each with the
	// policy version that generated it: a trainer can weigh or drop what an
	// older policy produced.
	Versions []VersionSpan `json:"versions,omitempty"`
	// Stale: the rollout was flagged stale (--max-staleness).
	Stale bool `json:"stale,omitempty"`
}

// VersionSpan is the completion tokens [Start, End) of a row (the ones
// loss_mask marks), generated by policy Version.
type VersionSpan struct {
	Start   int   `json:"start"`
	End     int   `json:"end"`
	Version int64 `json:"version"`
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

// Options says how Build merges.
type Options struct {
	// Merge is MergeExact (or empty, the default) or ModeRealign; check
	// what a request sends with ParseMerge.
	Merge string
	// VocabSize, when positive, is the policy's vocabulary size: a token
	// id at or above it makes its call a Problem.
	VocabSize int
	// CountOnly leaves the rows' TokenIDs, LossMask and Logprobs empty:
	// what counting rows, merges, drift and problems needs, for the cost
	// of comparing prefixes, without copying tokens.
	CountOnly bool
}

// ParseMerge checks a requested merge mode ("" is exact) and returns it,
// or an error naming the field "merge".
func ParseMerge(m string) (string, error) {
	switch m {
	case "", MergeExact:
		return MergeExact, nil
	case ModeRealign:
		return ModeRealign, nil
	}
	return "", fielderr.New("merge", "must be %q or %q, got %q", MergeExact, ModeRealign, m)
}

// step is one call of a row being planned: the row takes the call's
// prompt from start on, then its completion.
type step struct {
	call  int
	start int
}

// builder holds what Build carries from call to call.
type builder struct {
	s   Sample
	o   Options
	out Result
	// The row being planned.
	steps     []step
	drift     []Drift
	realigned bool
	// Problems since the last row started, for the next row; fork is set
	// once anything (a break, a problem) ended a row.
	pending []Problem
	fork    bool
	// Token texts: how many breaks looked them up, and, past a few, all.
	lookups int
	texts   map[int32]string
}

// Build returns the rows of one sample. It never fails: calls whose
// tokens are unusable are listed as problems and the rest still yield
// rows.
func Build(s Sample, o Options) Result {
	b := &builder{s: s, o: o}
	for i, c := range s.Calls {
		if c == nil {
			b.problem(i, "no call recorded")
			continue
		}
		if reason := checkCompletion(c, o.VocabSize); reason != "" {
			b.problem(i, reason)
			continue
		}
		p := c.PromptTokenIDs
		if len(b.steps) > 0 {
			prev := s.Calls[b.steps[len(b.steps)-1].call]
			d := parting(prev.PromptTokenIDs, prev.CompletionTokenIDs, p)
			if d < 0 {
				start := len(prev.PromptTokenIDs) + len(prev.CompletionTokenIDs)
				if reason := checkIDs("prompt", p, start, o.VocabSize); reason != "" {
					b.problem(i, reason)
					continue
				}
				b.steps = append(b.steps, step{call: i, start: start})
				continue
			}
			dr := Drift{Call: i, Position: d, Class: b.classify(prev, p, d)}
			if o.Merge == ModeRealign {
				if j := realignPoint(prev.PromptTokenIDs, prev.CompletionTokenIDs, p, d); j >= 0 {
					if reason := checkIDs("prompt", p, j, o.VocabSize); reason != "" {
						b.problem(i, reason)
						continue
					}
					dr.ContextTokensDiffer = j - d
					b.drift = append(b.drift, dr)
					b.steps = append(b.steps, step{call: i, start: j})
					b.realigned = true
					continue
				}
			}
			// Up to d the prompt is the previous call's, already checked.
			if reason := checkIDs("prompt", p, d, o.VocabSize); reason != "" {
				b.problem(i, reason)
				continue
			}
			b.flush()
			b.drift = append(b.drift, dr)
			b.steps = append(b.steps, step{call: i})
			continue
		}
		if reason := checkIDs("prompt", p, 0, o.VocabSize); reason != "" {
			b.problem(i, reason)
			continue
		}
		b.steps = append(b.steps, step{call: i})
	}
	b.flush()
	return b.out
}

// problem records call i as unusable: the row so far ends before it.
func (b *builder) problem(i int, reason string) {
	b.flush()
	p := Problem{Call: i, Reason: reason}
	b.out.Problems = append(b.out.Problems, p)
	b.pending = append(b.pending, p)
	b.fork = true
}

// flush turns the planned steps into a row, allocating its arrays once.
func (b *builder) flush() {
	if len(b.steps) == 0 {
		return
	}
	r := Row{
		RolloutID: b.s.RolloutID, SampleID: b.s.SampleID, Row: len(b.out.Rows), Reward: b.s.Reward,
		Merge: MergeExact, Calls: make([]int, len(b.steps)), Drift: b.drift, Problems: b.pending,
	}
	switch {
	case b.realigned:
		r.Merge = MergeRealigned
	case b.fork:
		r.Merge = MergeForked
	}
	at := 0
	r.Versions = make([]VersionSpan, len(b.steps))
	for k, st := range b.steps {
		r.Calls[k] = st.call
		c := b.s.Calls[st.call]
		at += len(c.PromptTokenIDs) - st.start
		r.Versions[k] = VersionSpan{Start: at, End: at + len(c.CompletionTokenIDs), Version: c.PolicyVersion}
		at += len(c.CompletionTokenIDs)
	}
	if !b.o.CountOnly {
		b.fill(&r)
	}
	b.out.Rows = append(b.out.Rows, r)
	b.steps, b.drift, b.pending, b.realigned, b.fork = b.steps[:0], nil, nil, false, true
}

// fill writes the planned steps' tokens into r.
func (b *builder) fill(r *Row) {
	n := 0
	for _, st := range b.steps {
		c := b.s.Calls[st.call]
		n += len(c.PromptTokenIDs) - st.start + len(c.CompletionTokenIDs)
	}
	r.TokenIDs, r.LossMask, r.Logprobs = make([]int32, 0, n), make([]int32, n), make([]float64, n)
	for _, st := range b.steps {
		c := b.s.Calls[st.call]
		r.TokenIDs = append(r.TokenIDs, c.PromptTokenIDs[st.start:]...)
		at := len(r.TokenIDs)
		r.TokenIDs = append(r.TokenIDs, c.CompletionTokenIDs...)
		for j := range c.CompletionTokenIDs {
			r.LossMask[at+j] = 1
		}
		copy(r.Logprobs[at:], c.Logprobs)
	}
}

// checkCompletion returns why c's completion cannot go into a row, or "".
func checkCompletion(c *osmo.LLMCall, vocab int) string {
	switch {
	case c.Error != "":
		return "call failed: " + c.Error
	case len(c.PromptTokenIDs) == 0 && len(c.CompletionTokenIDs) == 0:
		return withReason("no token ids", c.NoTokensReason)
	case len(c.PromptTokenIDs) == 0:
		return withReason("no prompt token ids", c.NoTokensReason)
	case len(c.CompletionTokenIDs) == 0:
		return withReason("no completion token ids", c.NoTokensReason)
	case len(c.Logprobs) == 0:
		return fmt.Sprintf("%d completion token ids but no logprobs", len(c.CompletionTokenIDs))
	case len(c.Logprobs) != len(c.CompletionTokenIDs):
		return fmt.Sprintf("%d completion token ids but %d logprobs", len(c.CompletionTokenIDs), len(c.Logprobs))
	}
	for j, lp := range c.Logprobs {
		if math.IsNaN(lp) || math.IsInf(lp, 0) || lp > 0 {
			return fmt.Sprintf("logprob %d is %v, not a log probability", j, lp)
		}
	}
	return checkIDs("completion", c.CompletionTokenIDs, 0, vocab)
}

func withReason(what, reason string) string {
	if reason == "" {
		return what
	}
	return what + ": " + reason
}

// checkIDs returns why ids[from:] holds an id no token has, or "".
func checkIDs(what string, ids []int32, from, vocab int) string {
	for j := from; j < len(ids); j++ {
		id := ids[j]
		if id < 0 {
			return fmt.Sprintf("%s token id %d at %d is negative", what, id, j)
		}
		if vocab > 0 && int(id) >= vocab {
			return fmt.Sprintf("%s token id %d at %d is outside the vocabulary of %d", what, id, j, vocab)
		}
	}
	return ""
}

// parting returns the first index at which next differs from prompt
// followed by completion, or -1 when next starts with both. A next that
// ends before them parts where it ends.
func parting(prompt, completion, next []int32) int {
	n := min(len(prompt), len(next))
	if d := firstDiff(prompt[:n], next[:n]); d >= 0 {
		return d
	}
	if len(next) < len(prompt) {
		return len(next)
	}
	rest := next[len(prompt):]
	n = min(len(completion), len(rest))
	if d := firstDiff(completion[:n], rest[:n]); d >= 0 {
		return len(prompt) + d
	}
	if len(rest) < len(completion) {
		return len(next)
	}
	return -1
}

// firstDiff returns the first index where a and b (of equal length)
// differ, or -1. It compares in blocks so that the common case, equal,
// runs at slices.Equal's speed.
func firstDiff(a, b []int32) int {
	const block = 256
	for i := 0; i < len(a); i += block {
		j := min(i+block, len(a))
		if slices.Equal(a[i:j], b[i:j]) {
			continue
		}
		for k := i; k < j; k++ {
			if a[k] != b[k] {
				return k
			}
		}
	}
	return -1
}

// realignPoint returns where, in next, the re-rendered turn of the
// previous call ends (the index after its end token), or -1. The previous
// sequence, prompt followed by completion, parts from next at d. Its last
// token must end the completion only (a stop token, not a word that also
// appears inside it); counting its occurrences from d in the previous
// sequence says which occurrence in next ends the same turn.
func realignPoint(prompt, completion, next []int32, d int) int {
	end := completion[len(completion)-1]
	if slices.Contains(completion[:len(completion)-1], end) {
		return -1
	}
	want := 1
	if d < len(prompt) {
		for _, id := range prompt[d:] {
			if id == end {
				want++
			}
		}
	}
	for j := d; j < len(next); j++ {
		if next[j] == end {
			if want--; want == 0 {
				return j + 1
			}
		}
	}
	return -1
}
