package rows

import (
	"encoding/json"
	"slices"
	"strings"

	"github.com/osmo-rl/osmo"
)

// The tags drift classes are named from, matched as text.
const (
	thinkOpen  = "<think>"
	thinkClose = "</think>"
	toolOpen   = "<tool_call>"
	toolClose  = "</tool_call>"
)

// Bounds of the search around a break; a break costs at most a pass over
// the previous completion's text and these few comparisons.
const (
	// promptTail is how many tokens before the completion (or before a
	// break in the prompt) the text view takes in: the generation prompt,
	// where a think region may open.
	promptTail = 16
	// promptAhead is how many prompt tokens from the break (when it is in
	// the prompt) the view reads, to find a region's closing tag.
	promptAhead = 64
	// reasoningAnchor is how many bytes of the reasoning's end are looked
	// for in a completion's text.
	reasoningAnchor = 32
	// scansBeforeMap is how many breaks of a sample look token texts up
	// by a pass over its completions before one map of them is built.
	scansBeforeMap = 4
	// resyncSkip is how many tokens either side may skip before the two
	// sequences agree again, and resyncRun how many must then agree.
	resyncSkip = 8
	resyncRun  = 4
)

// seq is the previous call's prompt followed by its completion, read
// without copying them.
type seq struct {
	prompt, completion []int32
	// strs are the completion's token texts; nil when unknown.
	strs []string
}

func (s seq) len() int { return len(s.prompt) + len(s.completion) }

func (s seq) at(i int) int32 {
	if i < len(s.prompt) {
		return s.prompt[i]
	}
	return s.completion[i-len(s.prompt)]
}

// classify names the break at d between prev's prompt and completion and
// next (see the package doc).
func (b *builder) classify(prev *osmo.LLMCall, next []int32, d int) string {
	if len(prev.CompletionTokenStrings) != len(prev.CompletionTokenIDs) {
		return DriftOther
	}
	old := seq{prompt: prev.PromptTokenIDs, completion: prev.CompletionTokenIDs, strs: prev.CompletionTokenStrings}

	// The text view: prompt tokens from a little before the break (or
	// before the completion) to a little after it, then the whole
	// completion. Prompt tokens are read where a completion of the sample
	// shows their text; so are the new prompt's tokens after the break.
	lo := max(0, min(d, len(old.prompt))-promptTail)
	hi := min(len(old.prompt), max(d, lo)+promptAhead)
	texts := b.lookup(old.prompt[lo:hi], next[d:min(len(next), d+resyncSkip)])
	oldText := func(i int) (string, bool) {
		switch {
		case i >= len(old.prompt):
			return tokenText(old.strs[i-len(old.prompt)])
		case i >= lo && i < hi:
			return texts.get(old.prompt[i])
		}
		return "", false
	}
	newText := func(i int) (string, bool) { return texts.get(next[i]) }

	var sb strings.Builder
	sb.Grow(hi - lo + 8*len(old.completion))
	// starts[i-lo] is where token i's text starts, for i up to hi; the
	// break's token is below hi.
	starts := make([]int, 0, hi-lo+len(old.completion)+2)
	completionAt := 0 // where the completion's text starts
	for i := lo; i < old.len(); i++ {
		if i == len(old.prompt) {
			completionAt = sb.Len()
		}
		starts = append(starts, sb.Len())
		if i == hi && hi < len(old.prompt) {
			// The prompt between the window and the completion, unread.
			sb.WriteByte(0)
			i = len(old.prompt) - 1
			continue
		}
		if t, ok := oldText(i); ok {
			sb.WriteString(t)
		} else {
			// An unknown token still separates what is around it.
			sb.WriteByte(0)
		}
	}
	starts = append(starts, sb.Len())
	text := sb.String()
	from, to := starts[d-lo], starts[d-lo+1]

	if inRegion(text, from, to, thinkOpen, thinkClose) {
		return DriftReasoningDropped
	}
	if inRegion(text, from, to, toolOpen, toolClose) {
		return DriftToolCallReserialized
	}
	if d >= len(old.prompt) {
		if class := byMessage(prev.ResponseMessage, text[completionAt:], from-completionAt); class != "" {
			return class
		}
	}

	a, bn, synced := resync(old, next, d)
	if synced && d < len(old.prompt) && d+a == len(old.prompt) {
		// The new prompt leaves out the rest of the previous prompt and
		// goes on with the completion: the generation prompt's own tail,
		// which templates add for a think block and do not re-render.
		if seen(d, d+a, oldText, thinkOnly) && seen(d, d+bn, newText, isSpace) && unknownOrTag(d, d+a, oldText) {
			return DriftReasoningDropped
		}
	}
	// Whitespace when what either side skipped is, as far as it can be
	// read, whitespace, and some of it can be read.
	if synced && seen(d, d+a, oldText, isSpace) && seen(d, d+bn, newText, isSpace) &&
		(anyKnown(d, d+a, oldText) || anyKnown(d, d+bn, newText)) {
		return DriftWhitespace
	}
	// Whitespace that leads into a think region the new prompt does not
	// resynchronise after: the region is gone, and the tokenizer merged
	// the whitespace around it differently ("assistant\n<think>…" against
	// "assistant\n\n\n\n<tool_call>").
	if to > from && isSpace(text[from:to]) && strings.HasPrefix(strings.TrimLeft(text[from:], " \t\r\n"), thinkOpen) {
		return DriftReasoningDropped
	}
	return DriftOther
}

// byMessage names a break at offset from in a completion's text that has
// no tags, from the message the policy's reply was parsed into: the
// reasoning's text ends a reasoning region; a tool call's function name
// starts a tool call region (from the start of its line).
func byMessage(raw json.RawMessage, text string, from int) string {
	if len(raw) == 0 {
		return ""
	}
	var m struct {
		Content          string `json:"content"`
		ReasoningContent string `json:"reasoning_content"`
		Reasoning        string `json:"reasoning"`
		ToolCalls        []struct {
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		} `json:"tool_calls"`
	}
	if json.Unmarshal(raw, &m) != nil {
		return ""
	}
	reasoning := strings.TrimSpace(m.ReasoningContent)
	if reasoning == "" {
		reasoning = strings.TrimSpace(m.Reasoning)
	}
	if reasoning != "" && !strings.Contains(text, thinkOpen) && !strings.Contains(text, thinkClose) {
		// The reasoning's last words mark where its region ends.
		anchor := reasoning[max(0, len(reasoning)-reasoningAnchor):]
		if i := strings.Index(text, anchor); i >= 0 && from < i+len(anchor) {
			return DriftReasoningDropped
		}
	}
	if len(m.ToolCalls) > 0 && m.ToolCalls[0].Function.Name != "" && !strings.Contains(text, toolOpen) {
		if i := strings.Index(text, m.ToolCalls[0].Function.Name); i >= 0 {
			if from >= strings.LastIndexByte(text[:i], '\n')+1 {
				return DriftToolCallReserialized
			}
		}
	}
	return ""
}

// textTable holds the texts of a few token ids, sorted by id, or of every
// id of the sample's completions.
type textTable struct {
	ids   []int32
	texts []string
	known []bool
	all   map[int32]string
}

func (t textTable) get(id int32) (string, bool) {
	if t.all != nil {
		s, ok := t.all[id]
		return s, ok
	}
	i, ok := slices.BinarySearch(t.ids, id)
	if !ok || !t.known[i] {
		return "", false
	}
	return t.texts[i], true
}

// lookup finds the texts of the given ids where a completion of the
// sample shows them: one pass over the sample's completions per break,
// for a few dozen ids, costs less than mapping every completion token.
func (b *builder) lookup(idSets ...[]int32) textTable {
	// Past a few breaks, one map of every completion token costs less than
	// a pass per break, which would grow with the square of the calls.
	if b.lookups++; b.lookups > scansBeforeMap {
		if b.texts == nil {
			b.texts = b.allTexts()
		}
		return textTable{all: b.texts}
	}
	var t textTable
	for _, ids := range idSets {
		t.ids = append(t.ids, ids...)
	}
	slices.Sort(t.ids)
	t.ids = slices.Compact(t.ids)
	if len(t.ids) == 0 {
		return t
	}
	t.texts = make([]string, len(t.ids))
	t.known = make([]bool, len(t.ids))
	// A 1024-bit filter of the wanted ids lets most completion tokens
	// pass by without a search.
	var filter [16]uint64
	for _, id := range t.ids {
		filter[(id>>6)&15] |= 1 << (id & 63)
	}
	left := len(t.ids)
	for _, c := range b.s.Calls {
		if c == nil || len(c.CompletionTokenStrings) != len(c.CompletionTokenIDs) {
			continue
		}
		for j, id := range c.CompletionTokenIDs {
			if filter[(id>>6)&15]&(1<<(id&63)) == 0 {
				continue
			}
			i, ok := slices.BinarySearch(t.ids, id)
			if !ok || t.known[i] {
				continue
			}
			if text, ok := tokenText(c.CompletionTokenStrings[j]); ok {
				t.texts[i], t.known[i] = text, true
				if left--; left == 0 {
					return t
				}
			}
		}
	}
	return t
}

// allTexts maps every id of the sample's completions to its text.
func (b *builder) allTexts() map[int32]string {
	n := 0
	for _, c := range b.s.Calls {
		if c != nil && len(c.CompletionTokenStrings) == len(c.CompletionTokenIDs) {
			n += len(c.CompletionTokenIDs)
		}
	}
	texts := make(map[int32]string, n)
	for _, c := range b.s.Calls {
		if c == nil || len(c.CompletionTokenStrings) != len(c.CompletionTokenIDs) {
			continue
		}
		for j, id := range c.CompletionTokenIDs {
			if _, dup := texts[id]; dup {
				continue
			}
			if t, ok := tokenText(c.CompletionTokenStrings[j]); ok {
				texts[id] = t
			}
		}
	}
	return texts
}

// tokenText is a token string's text, unless it names no text: empty, or
// vLLM's "token_id:N" (return_tokens_as_token_ids).
func tokenText(s string) (string, bool) {
	if s == "" || strings.HasPrefix(s, "token_id:") {
		return "", false
	}
	return s, true
}

// inRegion reports whether the token at text[from:to] starts or lies
// inside an open…close region. A region whose opening tag lies before the
// text (in an unknown prompt) counts when a closing tag comes first.
func inRegion(text string, from, to int, open, close string) bool {
	if o := strings.Index(text[from:], open); o >= 0 && from+o < to {
		return true
	}
	lastOpen := strings.LastIndex(text[:from], open)
	lastClose := strings.LastIndex(text[:from], close)
	if lastClose >= 0 && lastClose+len(close) > from {
		return true // the token is part of a closing tag split over tokens
	}
	if lastOpen >= 0 || lastClose >= 0 {
		return lastOpen > lastClose
	}
	nextOpen := strings.Index(text[from:], open)
	nextClose := strings.Index(text[from:], close)
	return nextClose >= 0 && (nextOpen < 0 || nextClose < nextOpen)
}

// resync finds the fewest tokens a (of the previous sequence) and b (of
// next) to skip after d so that the two agree again for resyncRun tokens
// (or for what remains of the previous sequence). ok is false when no
// such skip within resyncSkip exists.
func resync(old seq, next []int32, d int) (a, b int, ok bool) {
	for t := 1; t <= 2*resyncSkip; t++ {
		for a = max(0, t-resyncSkip); a <= min(t, resyncSkip); a++ {
			b = t - a
			ra, rb := old.len()-(d+a), len(next)-(d+b)
			if ra < 0 || rb < 0 {
				continue
			}
			if ra == 0 {
				// Everything left of the previous sequence skipped: next
				// goes on with new context right away.
				if b == 0 {
					return a, b, true
				}
				continue
			}
			m := min(resyncRun, ra)
			if rb < m {
				continue
			}
			same := true
			for k := range m {
				if old.at(d+a+k) != next[d+b+k] {
					same = false
					break
				}
			}
			if same {
				return a, b, true
			}
		}
	}
	return 0, 0, false
}

func isSpace(s string) bool { return strings.TrimSpace(s) == "" }

// thinkOnly reports whether s is whitespace once think tags are removed.
func thinkOnly(s string) bool {
	return isSpace(strings.NewReplacer(thinkOpen, "", thinkClose, "").Replace(s))
}

// seen reports whether every token in [lo, hi) whose text is known passes
// ok.
func seen(lo, hi int, text func(int) (string, bool), ok func(string) bool) bool {
	for i := lo; i < hi; i++ {
		if t, known := text(i); known && !ok(t) {
			return false
		}
	}
	return true
}

func anyKnown(lo, hi int, text func(int) (string, bool)) bool {
	for i := lo; i < hi; i++ {
		if _, known := text(i); known {
			return true
		}
	}
	return false
}

// unknownOrTag reports whether some token in [lo, hi) has unknown text or
// holds a think tag: what tells a dropped think block from whitespace.
func unknownOrTag(lo, hi int, text func(int) (string, bool)) bool {
	for i := lo; i < hi; i++ {
		t, known := text(i)
		if !known || strings.Contains(t, thinkOpen) || strings.Contains(t, thinkClose) {
			return true
		}
	}
	return false
}
