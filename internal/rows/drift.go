package rows

import (
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
	texts := b.tokenTexts()
	old := seq{prompt: prev.PromptTokenIDs, completion: prev.CompletionTokenIDs, strs: prev.CompletionTokenStrings}
	oldText := func(i int) (string, bool) {
		if i >= len(old.prompt) {
			return tokenText(old.strs[i-len(old.prompt)])
		}
		t, ok := texts[old.prompt[i]]
		return t, ok
	}

	// The text from a little before the break (or the completion) to the
	// end of the previous sequence, with each token's starting offset.
	lo := max(0, min(d, len(old.prompt))-promptTail)
	var sb strings.Builder
	starts := make([]int, 0, old.len()-lo+1)
	for i := lo; i < old.len(); i++ {
		starts = append(starts, sb.Len())
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

	a, bn, ok := resync(old, next, d)
	if !ok {
		return DriftOther
	}
	newText := func(i int) (string, bool) { t, ok := texts[next[i]]; return t, ok }
	if d < len(old.prompt) && d+a == len(old.prompt) {
		// The new prompt leaves out the rest of the previous prompt and
		// goes on with the completion: the generation prompt's own tail,
		// which templates add for a think block and do not re-render.
		if seen(d, d+a, oldText, thinkOnly) && seen(d, d+bn, newText, isSpace) && unknownOrTag(d, d+a, oldText) {
			return DriftReasoningDropped
		}
	}
	// Whitespace when what either side skipped is, as far as it can be
	// read, whitespace, and some of it can be read.
	if seen(d, d+a, oldText, isSpace) && seen(d, d+bn, newText, isSpace) &&
		(anyKnown(d, d+a, oldText) || anyKnown(d, d+bn, newText)) {
		return DriftWhitespace
	}
	return DriftOther
}

// tokenTexts maps the ids of the sample's completions to their texts, so
// that prompt tokens the policy once generated can be read too. Built on
// the first break only.
func (b *builder) tokenTexts() map[int32]string {
	if b.texts != nil {
		return b.texts
	}
	n := 0
	for _, c := range b.s.Calls {
		if c != nil && len(c.CompletionTokenStrings) == len(c.CompletionTokenIDs) {
			n += len(c.CompletionTokenIDs)
		}
	}
	b.texts = make(map[int32]string, n)
	for _, c := range b.s.Calls {
		if c == nil || len(c.CompletionTokenStrings) != len(c.CompletionTokenIDs) {
			continue
		}
		for j, id := range c.CompletionTokenIDs {
			if t, ok := tokenText(c.CompletionTokenStrings[j]); ok {
				if _, dup := b.texts[id]; !dup {
					b.texts[id] = t
				}
			}
		}
	}
	return b.texts
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
