package rows

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
)

// The words the tests use must not share ids, or a drift could hide.
func TestQwen3IDsAreDistinct(t *testing.T) {
	var q qwen3
	seen := map[int32]string{}
	for _, part := range [][]string{systemUser, thinkOff, toolCallCompact, toolCallSpaced, reasoning, toolResponse, answer,
		{"Hello", " there", "Hi", "<|endoftext|>", "\",", " {\""}} {
		for _, w := range part {
			id := q.id(w)
			if other, ok := seen[id]; ok && other != w {
				t.Fatalf("%q and %q share id %d", w, other, id)
			}
			seen[id] = w
		}
	}
}

// wantRow checks that r is the concatenation the package doc defines: the
// first call's prompt and completion, then each later call's prompt from
// starts[k] on and its completion, with the mask 1 exactly on completions
// and the logprobs there.
func wantRow(t *testing.T, r Row, calls []*osmo.LLMCall, idx []int, starts []int) {
	t.Helper()
	if !slices.Equal(r.Calls, idx) {
		t.Fatalf("%s: calls = %v, want %v", describe(r), r.Calls, idx)
	}
	var ids, mask []int32
	var lps []float64
	var spans []VersionSpan
	for k, i := range idx {
		c := calls[i]
		p := c.PromptTokenIDs[starts[k]:]
		ids = append(ids, p...)
		mask = append(mask, make([]int32, len(p))...)
		lps = append(lps, make([]float64, len(p))...)
		spans = append(spans, VersionSpan{Start: len(ids), End: len(ids) + len(c.CompletionTokenIDs), Version: c.PolicyVersion})
		ids = append(ids, c.CompletionTokenIDs...)
		for range c.CompletionTokenIDs {
			mask = append(mask, 1)
		}
		lps = append(lps, c.Logprobs...)
	}
	if !slices.Equal(r.TokenIDs, ids) || !slices.Equal(r.LossMask, mask) || !slices.Equal(r.Logprobs, lps) {
		t.Fatalf("%s:\n ids  %v\n want %v\n mask %v\n want %v\n lps  %v\n want %v", describe(r), r.TokenIDs, ids, r.LossMask, mask, r.Logprobs, lps)
	}
	if !slices.Equal(r.Versions, spans) {
		t.Fatalf("%s: versions = %v, want %v", describe(r), r.Versions, spans)
	}
}

// TestVersionSpans: each completion segment of a row carries the version
// of the call that generated it.
func TestVersionSpans(t *testing.T) {
	c0 := call(systemUser, cat(toolCallCompact, []string{"<|im_end|>"}))
	c0.PolicyVersion = 3
	p1 := cat(systemUser, toolCallCompact, []string{"<|im_end|>"}, toolResponse)
	c1 := call(p1, answer)
	c1.PolicyVersion = 4
	calls := []*osmo.LLMCall{c0, c1}
	r := Build(Sample{RolloutID: "r1", SampleID: "s1", Calls: calls}, Options{}).Rows[0]
	wantRow(t, r, calls, []int{0, 1}, []int{0, len(c0.PromptTokenIDs) + len(c0.CompletionTokenIDs)})
	if r.Versions[0].Version != 3 || r.Versions[1].Version != 4 || r.Versions[0].Start != len(c0.PromptTokenIDs) {
		t.Fatalf("versions = %v", r.Versions)
	}
	// Counting rows still says which versions they hold.
	if got := Build(Sample{Calls: calls}, Options{CountOnly: true}).Rows[0].Versions; !slices.Equal(got, r.Versions) {
		t.Errorf("CountOnly versions = %v, want %v", got, r.Versions)
	}
}

func TestExactToolLoopIsOneRow(t *testing.T) {
	c0 := call(systemUser, cat(toolCallCompact, []string{"<|im_end|>"}))
	p1 := cat(systemUser, toolCallCompact, []string{"<|im_end|>"}, toolResponse)
	c1 := call(p1, answer)
	reward := 1.0
	res := Build(Sample{RolloutID: "r1", SampleID: "s1", Reward: &reward, Calls: []*osmo.LLMCall{c0, c1}}, Options{})
	if len(res.Rows) != 1 || len(res.Problems) != 0 {
		t.Fatalf("want one row, got:\n%s", describeAll(res))
	}
	r := res.Rows[0]
	if r.Merge != MergeExact || r.Row != 0 || r.RolloutID != "r1" || r.SampleID != "s1" || r.Reward == nil || *r.Reward != 1 || len(r.Drift) != 0 {
		t.Fatalf("row = %s, reward %v", describe(r), r.Reward)
	}
	wantRow(t, r, []*osmo.LLMCall{c0, c1}, []int{0, 1}, []int{0, len(c0.PromptTokenIDs) + len(c0.CompletionTokenIDs)})
	// In exact mode the row is the last call's prompt and completion.
	if !slices.Equal(r.TokenIDs, slices.Concat(c1.PromptTokenIDs, c1.CompletionTokenIDs)) {
		t.Fatal("row is not the last call's prompt followed by its completion")
	}
}

func TestDriftClasses(t *testing.T) {
	end := []string{"<|im_end|>"}
	tests := []struct {
		name string
		// The first call's prompt and completion, and the second call's
		// prompt (a re-render), as token texts.
		prompt, completion, next []string
		class                    string
		position                 int // index into prompt+completion
		noStrings                bool
	}{{
		// The agent dropped the reasoning: the template re-renders the
		// turn without it, and a content of "\n\n" gives "\n\n\n".
		name:       "reasoning dropped",
		prompt:     systemUser,
		completion: cat(reasoning, toolCallCompact, end),
		next:       cat(systemUser, []string{"\n\n\n"}, toolCallCompact, end, toolResponse),
		class:      DriftReasoningDropped,
		position:   len(systemUser),
	}, {
		// Qwen3's tokenizer merges the generation prompt's "\n" with the
		// re-rendered content's: the sequences part just before the
		// think region, on whitespace.
		name:       "reasoning dropped, newlines merged",
		prompt:     systemUser,
		completion: cat(reasoning, toolCallCompact, end),
		next:       cat(systemUser[:len(systemUser)-1], []string{"\n\n\n\n"}, toolCallCompact, end, toolResponse),
		class:      DriftReasoningDropped,
		position:   len(systemUser) - 1,
	}, {
		// The reasoning went back but the template strips its inside.
		name:       "inside the reasoning",
		prompt:     systemUser,
		completion: cat(reasoning, toolCallCompact, end),
		next:       cat(systemUser, []string{"<think>", "\n", "Let", " me", " multiply", ".", "</think>", "\n\n"}, toolCallCompact, end, toolResponse),
		class:      DriftReasoningDropped,
		position:   len(systemUser) + 6,
	}, {
		// Thinking off: the generation prompt's empty think block is
		// left out of the next render; its tokens' texts are unknown.
		name:       "generation prompt think block",
		prompt:     cat(systemUser, thinkOff),
		completion: cat(toolCallCompact, end),
		next:       cat(systemUser, toolCallCompact, end, toolResponse),
		class:      DriftReasoningDropped,
		position:   len(systemUser),
	}, {
		name:       "tool call re-serialized",
		prompt:     systemUser,
		completion: cat(toolCallCompact, end),
		next:       cat(systemUser, toolCallSpaced, end, toolResponse),
		class:      DriftToolCallReserialized,
		position:   len(systemUser) + 14,
	}, {
		// The reasoning went back; the template puts "\n" more before
		// the tool call.
		name:       "whitespace after the reasoning",
		prompt:     systemUser,
		completion: cat(reasoning, toolCallCompact, end),
		next:       cat(systemUser, reasoning[:8], []string{"\n\n\n"}, toolCallCompact, end, toolResponse),
		class:      DriftWhitespace,
		position:   len(systemUser) + 8,
	}, {
		name:       "trailing whitespace trimmed",
		prompt:     systemUser,
		completion: []string{"Hello", " there", " ", "<|im_end|>"},
		next:       cat(systemUser, []string{"Hello", " there", "<|im_end|>"}, toolResponse),
		class:      DriftWhitespace,
		position:   len(systemUser) + 2,
	}, {
		name:       "content rewritten",
		prompt:     systemUser,
		completion: []string{"Hello", " there", "<|im_end|>"},
		next:       cat(systemUser, []string{"Hi", "<|im_end|>"}, toolResponse),
		class:      DriftOther,
		position:   len(systemUser),
	}, {
		name:       "history rewritten",
		prompt:     systemUser,
		completion: cat(toolCallCompact, end),
		next:       cat([]string{"<|im_start|>", "system", "\n", "Hi"}, systemUser[4:], toolCallCompact, end, toolResponse),
		class:      DriftOther,
		position:   3,
	}, {
		name:       "no token strings",
		prompt:     systemUser,
		completion: cat(reasoning, toolCallCompact, end),
		next:       cat(systemUser, []string{"\n\n\n"}, toolCallCompact, end, toolResponse),
		class:      DriftOther,
		position:   len(systemUser),
		noStrings:  true,
	}, {
		// The stop token the engine returned is not re-rendered.
		name:       "next prompt ends early",
		prompt:     systemUser,
		completion: []string{"Hello", " there", " ", "<|endoftext|>"},
		next:       cat(systemUser, []string{"Hello", " there"}),
		class:      DriftOther,
		position:   len(systemUser) + 2,
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c0 := call(tc.prompt, tc.completion)
			if tc.noStrings {
				c0.CompletionTokenStrings = nil
			}
			c1 := call(tc.next, answer)
			calls := []*osmo.LLMCall{c0, c1}
			res := Build(Sample{Calls: calls}, Options{})
			if len(res.Rows) != 2 || len(res.Problems) != 0 {
				t.Fatalf("want two rows:\n%s", describeAll(res))
			}
			if r := res.Rows[0]; r.Merge != MergeExact || len(r.Drift) != 0 {
				t.Fatalf("first row: %s", describe(r))
			}
			r := res.Rows[1]
			if r.Merge != MergeForked || r.Row != 1 {
				t.Fatalf("second row: %s", describe(r))
			}
			want := []Drift{{Call: 1, Position: tc.position, Class: tc.class}}
			if !slices.Equal(r.Drift, want) {
				t.Fatalf("drift = %+v, want %+v", r.Drift, want)
			}
			wantRow(t, res.Rows[0], calls, []int{0}, []int{0})
			wantRow(t, r, calls, []int{1}, []int{0})
		})
	}
}

// Tags are matched as text: a tokenizer that splits them still names the
// class, and a think region opened in the generation prompt (DeepSeek-R1)
// counts from its closing tag.
func TestDriftTagsAsText(t *testing.T) {
	end := []string{"<|im_end|>"}
	t.Run("split tool call tag", func(t *testing.T) {
		open := []string{"<", "tool", "_call", ">", "\n"}
		comp := cat(open, toolCallCompact[1:], end)
		next := cat(systemUser, open, toolCallSpaced[1:], end, toolResponse)
		res := Build(Sample{Calls: []*osmo.LLMCall{call(systemUser, comp), call(next, answer)}}, Options{})
		if got := res.Rows[1].Drift; len(got) != 1 || got[0].Class != DriftToolCallReserialized {
			t.Fatalf("drift = %+v", got)
		}
	})
	t.Run("think opened in the prompt", func(t *testing.T) {
		prompt := cat(systemUser, []string{"<think>", "\n"})
		comp := cat([]string{"Let", " me", " multiply", ".", "\n", "</think>", "\n\n"}, toolCallCompact, end)
		next := cat(systemUser, []string{"<think>", "\n", "Let", " multiply", "</think>", "\n\n"}, toolCallCompact, end, toolResponse)
		res := Build(Sample{Calls: []*osmo.LLMCall{call(prompt, comp), call(next, answer)}}, Options{})
		if got := res.Rows[1].Drift; len(got) != 1 || got[0].Class != DriftReasoningDropped || got[0].Position != len(prompt)+1 {
			t.Fatalf("drift = %+v", got)
		}
	})
	t.Run("think known from another completion", func(t *testing.T) {
		// The generation prompt's think block, whose ids a completion
		// of the same sample shows are think tags.
		c0 := call(systemUser, cat(reasoning, []string{"Hi", "<|im_end|>"}))
		p1 := cat(systemUser, []string{"Hi", "<|im_end|>"}, toolResponse, thinkOff)
		c1 := call(p1, cat(toolCallCompact, end))
		p2 := cat(systemUser, []string{"Hi", "<|im_end|>"}, toolResponse, toolCallCompact, end, toolResponse)
		res := Build(Sample{Calls: []*osmo.LLMCall{c0, c1, call(p2, answer)}}, Options{})
		last := res.Rows[len(res.Rows)-1]
		if len(last.Drift) != 1 || last.Drift[0].Class != DriftReasoningDropped || last.Drift[0].Position != len(p1)-len(thinkOff) {
			t.Fatalf("rows:\n%s", describeAll(res))
		}
	})
}

func TestRealign(t *testing.T) {
	end := []string{"<|im_end|>"}
	c0 := call(systemUser, cat(reasoning, toolCallCompact, end))
	p1 := cat(systemUser, []string{"\n\n\n"}, toolCallCompact, end, toolResponse)
	c1 := call(p1, cat(toolCallCompact, end))
	// The third call extends the second exactly.
	p2 := cat(p1, toolCallCompact, end, toolResponse)
	c2 := call(p2, answer)
	calls := []*osmo.LLMCall{c0, c1, c2}

	res := Build(Sample{Calls: calls}, Options{Merge: ModeRealign})
	if len(res.Rows) != 1 || len(res.Problems) != 0 {
		t.Fatalf("want one row:\n%s", describeAll(res))
	}
	r := res.Rows[0]
	// The re-rendered turn is "\n\n\n", the tool call and <|im_end|>.
	differ := 1 + len(toolCallCompact) + 1
	want := []Drift{{Call: 1, Position: len(systemUser), Class: DriftReasoningDropped, ContextTokensDiffer: differ}}
	if r.Merge != MergeRealigned || !slices.Equal(r.Drift, want) {
		t.Fatalf("row %s, want drift %+v", describe(r), want)
	}
	wantRow(t, r, calls, []int{0, 1, 2}, []int{0, len(systemUser) + differ, len(p1) + len(c1.CompletionTokenIDs)})

	// Exact mode forks at the same place, and the third call merges
	// into the second's row.
	res = Build(Sample{Calls: calls}, Options{})
	if len(res.Rows) != 2 || res.Rows[1].Merge != MergeForked || !slices.Equal(res.Rows[1].Calls, []int{1, 2}) {
		t.Fatalf("exact:\n%s", describeAll(res))
	}
	wantRow(t, res.Rows[1], calls, []int{1, 2}, []int{0, len(p1) + len(c1.CompletionTokenIDs)})
}

func TestRealignForksWhenTheTurnEndIsNotFound(t *testing.T) {
	tests := []struct {
		name       string
		completion []string
		next       []string
	}{{
		// Cut by length: the last token is a word that appears inside
		// the completion too, so it marks no turn's end.
		name:       "no stop token",
		completion: []string{"Hello", " there", "Hello"},
		next:       cat(systemUser, []string{"Hi", "<|im_end|>"}, toolResponse),
	}, {
		name:       "stop token not re-rendered",
		completion: []string{"Hello", " there", "<|endoftext|>"},
		next:       cat(systemUser, []string{"Hi", "<|im_end|>"}, toolResponse),
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			calls := []*osmo.LLMCall{call(systemUser, tc.completion), call(tc.next, answer)}
			res := Build(Sample{Calls: calls}, Options{Merge: ModeRealign})
			if len(res.Rows) != 2 || res.Rows[1].Merge != MergeForked || res.Rows[1].Drift[0].ContextTokensDiffer != 0 {
				t.Fatalf("want a fork:\n%s", describeAll(res))
			}
		})
	}
}

func TestProblems(t *testing.T) {
	good := func() *osmo.LLMCall { return call(systemUser, []string{"Hello", "<|im_end|>"}) }
	tests := []struct {
		name   string
		bad    func(c *osmo.LLMCall)
		vocab  int
		reason string
	}{
		{"no ids", func(c *osmo.LLMCall) {
			c.PromptTokenIDs, c.CompletionTokenIDs, c.Logprobs = nil, nil, nil
			c.NoTokensReason = "the policy refused return_token_ids"
		}, 0, "no token ids: the policy refused return_token_ids"},
		{"no prompt ids", func(c *osmo.LLMCall) { c.PromptTokenIDs = nil }, 0, "no prompt token ids"},
		{"no completion ids", func(c *osmo.LLMCall) { c.CompletionTokenIDs = nil }, 0, "no completion token ids"},
		{"no logprobs", func(c *osmo.LLMCall) { c.Logprobs = nil }, 0, "2 completion token ids but no logprobs"},
		{"logprobs short", func(c *osmo.LLMCall) { c.Logprobs = c.Logprobs[:1] }, 0, "2 completion token ids but 1 logprobs"},
		{"logprob positive", func(c *osmo.LLMCall) { c.Logprobs[1] = 0.5 }, 0, "logprob 1 is 0.5, not a log probability"},
		{"negative id", func(c *osmo.LLMCall) { c.PromptTokenIDs[3] = -1 }, 0, "prompt token id -1 at 3 is negative"},
		{"id outside the vocabulary", func(c *osmo.LLMCall) { c.CompletionTokenIDs[0] = 151936 }, 151936,
			"completion token id 151936 at 0 is outside the vocabulary of 151936"},
		{"failed", func(c *osmo.LLMCall) { c.Error = "llmproxy: upstream stream broke: EOF" }, 0,
			"call failed: llmproxy: upstream stream broke: EOF"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bad := good()
			tc.bad(bad)
			// A good call, the bad one, then a call that extends the
			// first exactly: it still starts a new row.
			c0 := good()
			p2 := cat(systemUser, []string{"Hello", "<|im_end|>"}, toolResponse)
			c2 := call(p2, answer)
			calls := []*osmo.LLMCall{c0, bad, c2}
			res := Build(Sample{Calls: calls}, Options{VocabSize: tc.vocab})
			want := []Problem{{Call: 1, Reason: tc.reason}}
			if !slices.Equal(res.Problems, want) || len(res.Rows) != 2 {
				t.Fatalf("want problems %+v and two rows:\n%s", want, describeAll(res))
			}
			if r := res.Rows[0]; r.Merge != MergeExact || len(r.Problems) != 0 {
				t.Fatalf("first row: %s", describe(r))
			}
			if r := res.Rows[1]; r.Merge != MergeForked || !slices.Equal(r.Problems, want) || len(r.Drift) != 0 {
				t.Fatalf("second row: %s", describe(r))
			}
			wantRow(t, res.Rows[0], calls, []int{0}, []int{0})
			wantRow(t, res.Rows[1], calls, []int{2}, []int{0})

			// As the last call, the problem is only in the summary; as
			// the first, the row after it is forked.
			res = Build(Sample{Calls: []*osmo.LLMCall{c0, bad}}, Options{VocabSize: tc.vocab})
			if len(res.Rows) != 1 || len(res.Rows[0].Problems) != 0 || !slices.Equal(res.Problems, want) {
				t.Fatalf("problem last:\n%s", describeAll(res))
			}
			res = Build(Sample{Calls: []*osmo.LLMCall{bad, c0}}, Options{VocabSize: tc.vocab})
			if len(res.Rows) != 1 || res.Rows[0].Merge != MergeForked || res.Problems[0].Call != 0 {
				t.Fatalf("problem first:\n%s", describeAll(res))
			}
		})
	}
}

// A prompt id outside the vocabulary in the context a call adds is found
// though the prefix before it was checked with the earlier call.
func TestProblemInAddedContext(t *testing.T) {
	c0 := call(systemUser, []string{"Hello", "<|im_end|>"})
	c1 := call(cat(systemUser, []string{"Hello", "<|im_end|>"}, toolResponse), answer)
	c1.PromptTokenIDs[len(c1.PromptTokenIDs)-2] = 200000
	res := Build(Sample{Calls: []*osmo.LLMCall{c0, c1}}, Options{VocabSize: 151936})
	if len(res.Rows) != 1 || len(res.Problems) != 1 || !strings.Contains(res.Problems[0].Reason, "200000") {
		t.Fatalf("rows:\n%s", describeAll(res))
	}
}

func TestNoCallsNoRows(t *testing.T) {
	res := Build(Sample{}, Options{})
	if len(res.Rows) != 0 || len(res.Problems) != 0 {
		t.Fatalf("got %s", describeAll(res))
	}
	res = Build(Sample{Calls: []*osmo.LLMCall{nil}}, Options{})
	if len(res.Rows) != 0 || len(res.Problems) != 1 {
		t.Fatalf("got %s", describeAll(res))
	}
}

func TestParseMerge(t *testing.T) {
	for in, want := range map[string]string{"": MergeExact, "exact": MergeExact, "realign": ModeRealign} {
		if got, err := ParseMerge(in); err != nil || got != want {
			t.Fatalf("ParseMerge(%q) = %q, %v", in, got, err)
		}
	}
	_, err := ParseMerge("forked")
	var fe *fielderr.Error
	if !errors.As(err, &fe) || fe.Field != "merge" {
		t.Fatalf("ParseMerge(forked) = %v, want an error naming merge", err)
	}
}

// The row's JSON is the API's Row: protojson reads every field of it,
// rejecting any name the proto does not have.
func TestRowIsTheAPIRow(t *testing.T) {
	end := []string{"<|im_end|>"}
	c0 := call(systemUser, cat(reasoning, toolCallCompact, end))
	c1 := call(cat(systemUser, []string{"\n\n\n"}, toolCallCompact, end, toolResponse), answer)
	reward := 0.5
	res := Build(Sample{RolloutID: "r", SampleID: "s", Reward: &reward, Calls: []*osmo.LLMCall{nil, c0, c1}}, Options{Merge: ModeRealign})
	r := res.Rows[0]
	r.Cursor = "c1"
	if len(r.Drift) != 1 || len(r.Problems) != 1 {
		t.Fatalf("want a drift and a problem: %s", describe(r))
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var pb rolloutv1.Row
	if err := protojson.Unmarshal(b, &pb); err != nil {
		t.Fatalf("%v in %s", err, b)
	}
	calls := make([]int32, len(r.Calls))
	for i, c := range r.Calls {
		calls[i] = int32(c)
	}
	d, p := pb.GetDrift()[0], pb.GetProblems()[0]
	if pb.GetRolloutId() != "r" || pb.GetSampleId() != "s" || pb.GetRow() != 0 || !slices.Equal(pb.GetTokenIds(), r.TokenIDs) ||
		!slices.Equal(pb.GetLossMask(), r.LossMask) || !slices.Equal(pb.GetLogprobs(), r.Logprobs) || pb.GetReward() != 0.5 ||
		pb.GetMerge() != MergeRealigned || !slices.Equal(pb.GetCalls(), calls) || pb.GetCursor() != "c1" ||
		int(d.GetCall()) != r.Drift[0].Call || int(d.GetPosition()) != r.Drift[0].Position || d.GetClass() != r.Drift[0].Class ||
		int(d.GetContextTokensDiffer()) != r.Drift[0].ContextTokensDiffer || d.GetContextTokensDiffer() == 0 ||
		p.GetCall() != 0 || p.GetReason() != r.Problems[0].Reason {
		t.Fatalf("proto row %v from %s", &pb, b)
	}
}

// A completion without tags is read with the message the policy's reply
// was parsed into: a Llama-style tool call and a gpt-oss-style reasoning
// channel.
func TestDriftFromMessages(t *testing.T) {
	prompt := []string{"<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", "What", " is", " ", "3", " *", " ", "4", "?", "<|eot_id|>",
		"<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"}
	tests := []struct {
		name       string
		completion []string
		message    string
		next       []string
		class      string
	}{{
		name:       "tool call without tags",
		completion: []string{"{\"", "name", "\":", " \"", "multiply", "\",", " \"", "parameters", "\":", " {\"", "a", "\":", "3", "}}", "<|eom_id|>"},
		message:    `{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":3}"}}]}`,
		next: cat(prompt, []string{"{\"", "name", "\":", " \"", "multiply", "\",", " \"", "parameters", "\":", " {\"", "a", "\":", " ", "3", "}}", "<|eom_id|>"},
			[]string{"<|start_header_id|>", "ipython"}),
		class: DriftToolCallReserialized,
	}, {
		name:       "content before a tool call is not in it",
		completion: []string{"Hello", " there", "\n", "{\"", "name", "\":", " \"", "multiply", "\"}", "<|eom_id|>"},
		message:    `{"role":"assistant","content":"Hello there","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{}"}}]}`,
		next:       cat(prompt, []string{"Hi", "\n", "{\"", "name", "\":", " \"", "multiply", "\"}", "<|eom_id|>"}),
		class:      DriftOther,
	}, {
		name: "reasoning channel dropped",
		completion: []string{"<|channel|>", "analysis", "<|message|>", "Let", " me", " multiply", ".", "<|end|>",
			"<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "12", "<|return|>"},
		message: `{"role":"assistant","content":"12","reasoning_content":"Let me multiply."}`,
		next:    cat(prompt, []string{"<|channel|>", "final", "<|message|>", "12", "<|end|>"}),
		class:   DriftReasoningDropped,
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c0 := call(prompt, tc.completion)
			c0.ResponseMessage = json.RawMessage(tc.message)
			res := Build(Sample{Calls: []*osmo.LLMCall{c0, call(tc.next, answer)}}, Options{})
			if len(res.Rows) != 2 || len(res.Rows[1].Drift) != 1 || res.Rows[1].Drift[0].Class != tc.class {
				t.Fatalf("want %s:\n%s", tc.class, describeAll(res))
			}
		})
	}
}
