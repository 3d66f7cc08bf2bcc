package rows

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo"
)

// benchSample is a typical agent sample: six calls, a 2k-token first
// prompt, 150-token completions ending with <|im_end|>, and 60 tokens of
// tool result between turns. With drop, each completion opens with a
// 40-token think block that the next prompt leaves out.
func benchSample(drop bool) Sample {
	rng := rand.New(rand.NewPCG(1, 2))
	words := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(rng.IntN(150000))
		}
		return out
	}
	var calls []*osmo.LLMCall
	prompt := words(2000)
	for range 6 {
		think := slices.Concat([]int32{151667}, words(38), []int32{151668})
		body := slices.Concat(words(109), []int32{151645})
		comp := body
		if drop {
			comp = slices.Concat(think, body)
		}
		c := &osmo.LLMCall{PromptTokenIDs: prompt, CompletionTokenIDs: comp, Logprobs: make([]float64, len(comp)),
			CompletionTokenStrings: make([]string, len(comp))}
		for i := range comp {
			c.Logprobs[i] = -rng.Float64()
			c.CompletionTokenStrings[i] = "w"
		}
		if drop {
			c.CompletionTokenStrings[0], c.CompletionTokenStrings[len(think)-1] = "<think>", "</think>"
		}
		calls = append(calls, c)
		prompt = slices.Concat(prompt, body, words(60))
	}
	return Sample{RolloutID: "r", SampleID: "s", Calls: calls}
}

func BenchmarkBuild(b *testing.B) {
	for _, bc := range []struct {
		name string
		drop bool
		o    Options
	}{
		{"exact", false, Options{}},
		{"forked", true, Options{}},
		{"realigned", true, Options{Merge: ModeRealign}},
		{"forked/count-only", true, Options{CountOnly: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s := benchSample(bc.drop)
			b.ReportAllocs()
			for b.Loop() {
				Build(s, bc.o)
			}
		})
	}
}

// The benchmark's samples are what they claim to be.
func TestBenchSample(t *testing.T) {
	res := Build(benchSample(false), Options{})
	if len(res.Rows) != 1 || len(res.Rows[0].Calls) != 6 {
		t.Fatalf("exact: %s", describeAll(res))
	}
	res = Build(benchSample(true), Options{})
	if len(res.Rows) != 6 || res.Rows[5].Drift[0].Class != DriftReasoningDropped {
		t.Fatalf("forked: %s", describeAll(res))
	}
	res = Build(benchSample(true), Options{Merge: ModeRealign})
	if len(res.Rows) != 1 || res.Rows[0].Merge != MergeRealigned || len(res.Rows[0].Drift) != 5 {
		t.Fatalf("realigned: %s", describeAll(res))
	}
	checkInvariants(t, benchSample(true).Calls, Options{Merge: ModeRealign}, res)
}

// The committed seed corpus exercises every kind of row, every drift
// class and problems, so that the fuzz test checks them all under plain
// go test.
func TestFuzzCorpusCoversEveryCase(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzBuild")
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		if len(lines) < 3 {
			t.Fatalf("%s: not a corpus file", e.Name())
		}
		data, err := strconv.Unquote(strings.TrimSuffix(strings.TrimPrefix(lines[1], "[]byte("), ")"))
		if err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		o := Options{VocabSize: len(fuzzTexts)}
		if lines[2] == "bool(true)" {
			o.Merge = ModeRealign
		}
		res := Build(Sample{Calls: fuzzCalls([]byte(data))}, o)
		for _, r := range res.Rows {
			seen[r.Merge] = true
			for _, d := range r.Drift {
				seen[d.Class] = true
			}
		}
		if len(res.Problems) > 0 {
			seen["problem"] = true
		}
	}
	for _, want := range []string{MergeExact, MergeForked, MergeRealigned, DriftReasoningDropped, DriftToolCallReserialized,
		DriftWhitespace, DriftOther, "problem"} {
		if !seen[want] {
			t.Errorf("no seed gives %s", want)
		}
	}
}
