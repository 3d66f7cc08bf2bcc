package graders_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/osmotest"
)

// gradeOne runs the grader spec names on one sample whose last assistant
// message is answer.
func gradeOne(t *testing.T, spec string, label *string, answer string) (float64, error) {
	t.Helper()
	g, err := graders.Lookup(spec)
	if err != nil {
		t.Fatalf("Lookup(%q): %v", spec, err)
	}
	gc := osmotest.NewGraderContext("r1", []*osmo.Sample{{
		ID: "s1",
		Messages: []osmo.Message{
			{"role": "user", "content": "question"},
			{"role": "assistant", "content": answer},
		},
	}}, label, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := g.Grade(ctx, gc); err != nil {
		return 0, err
	}
	r, ok := gc.Reward("s1")
	if !ok {
		t.Fatalf("%s: no error and no reward", spec)
	}
	return r, nil
}

func str(s string) *string { return &s }

type gradeCase struct {
	name    string
	spec    string
	label   *string
	answer  string
	want    float64
	wantErr string // substring of the error; "" means success
}

func runCases(t *testing.T, cases []gradeCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := gradeOne(t, tc.spec, tc.label, tc.answer)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if got != tc.want {
				t.Fatalf("reward = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestExact(t *testing.T) {
	runCases(t, []gradeCase{
		{name: "equal", spec: "exact", label: str("42"), answer: "42", want: 1},
		{name: "trimmed both sides", spec: "exact", label: str(" 42\n"), answer: "\t42 ", want: 1},
		{name: "different", spec: "exact", label: str("42"), answer: "The answer is 42", want: 0},
		{name: "case matters", spec: "exact", label: str("Paris"), answer: "paris", want: 0},
		{name: "no assistant text", spec: "exact", label: str("42"), answer: "", want: 0},
		{name: "missing label", spec: "exact", label: nil, answer: "42", wantErr: "exact: no label"},
		{name: "blank label", spec: "exact", label: str("  "), answer: "", wantErr: "label is blank"},
	})
}

func TestContains(t *testing.T) {
	runCases(t, []gradeCase{
		{name: "substring", spec: "contains", label: str("42"), answer: "so 6*7 = 42.", want: 1},
		{name: "label trimmed", spec: "contains", label: str(" 42 \n"), answer: "=42=", want: 1},
		{name: "absent", spec: "contains", label: str("42"), answer: "41", want: 0},
		{name: "missing label", spec: "contains", answer: "42", wantErr: "contains: no label"},
		{name: "blank label would match anything", spec: "contains", label: str(""), answer: "x", wantErr: "label is blank"},
	})
}

func TestAnswer(t *testing.T) {
	gsm := "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"
	runCases(t, []gradeCase{
		{name: "gsm8k label", spec: "answer", label: str(gsm), answer: "reasoning...\n#### 72", want: 1},
		{name: "plain label", spec: "answer", label: str("72"), answer: "#### 72", want: 1},
		{name: "numeric equality", spec: "answer", label: str("#### 42"), answer: "#### 42.0", want: 1},
		{name: "thousands separator", spec: "answer", label: str("1000"), answer: "#### 1,000", want: 1},
		{name: "last marker wins", spec: "answer", label: str("7"), answer: "#### 5 is wrong, so\n#### 7", want: 1},
		{name: "only the marker's line", spec: "answer", label: str("7"), answer: "#### 7\nbecause 3+4", want: 1},
		{name: "no marker in answer", spec: "answer", label: str("72"), answer: "the answer is 72", want: 0},
		{name: "wrong number", spec: "answer", label: str("72"), answer: "#### 71", want: 0},
		{name: "text compared exactly", spec: "answer", label: str("Paris"), answer: "#### paris", want: 0},
		{name: "text equal", spec: "answer", label: str("Paris"), answer: "####Paris", want: 1},
		{name: "empty after marker", spec: "answer", label: str("72"), answer: "####", want: 0},
		{name: "missing label", spec: "answer", answer: "#### 1", wantErr: "answer: no label"},
		{name: "label with empty final answer", spec: "answer", label: str("work\n####  "), answer: "#### 1", wantErr: `nothing after "####"`},
	})
}

func TestNumeric(t *testing.T) {
	runCases(t, []gradeCase{
		{name: "last number in text", spec: "numeric", label: str("42"), answer: "6 times 7 is 42.", want: 1},
		{name: "earlier numbers ignored", spec: "numeric", label: str("6"), answer: "6 times 7 is 42", want: 0},
		{name: "after marker first number", spec: "numeric", label: str("42"), answer: "I tried 41.\n#### 42 (6*7)", want: 1},
		{name: "commas", spec: "numeric", label: str("1234"), answer: "total: 1,234", want: 1},
		{name: "label with commas", spec: "numeric", label: str("1,234,567.5"), answer: "1234567.5", want: 1},
		{name: "negative", spec: "numeric", label: str("-3"), answer: "x = -3", want: 1},
		{name: "minus between numbers is not a sign", spec: "numeric", label: str("2"), answer: "5-3=2", want: 1},
		{name: "hyphenated word", spec: "numeric", label: str("5"), answer: "step-5", want: 1},
		{name: "plus sign", spec: "numeric", label: str("3"), answer: "(+3)", want: 1},
		{name: "decimal without leading digit", spec: "numeric", label: str("0.5"), answer: "p = .5", want: 1},
		{name: "decimal", spec: "numeric", label: str("3.14159"), answer: "pi is about 3.14159.", want: 1},
		{name: "ungrouped commas are a list", spec: "numeric", label: str("3"), answer: "1,2,3", want: 1},
		{name: "within default rel", spec: "numeric", label: str("1000000"), answer: "1000000.5", want: 1},
		{name: "outside default tolerance", spec: "numeric", label: str("1"), answer: "1.001", want: 0},
		{name: "rel param", spec: "numeric:rel=0.01", label: str("100"), answer: "100.9", want: 1},
		{name: "rel param too tight", spec: "numeric:rel=0.001", label: str("100"), answer: "100.9", want: 0},
		{name: "abs param", spec: "numeric:abs=0.5,rel=0", label: str("0"), answer: "0.4", want: 1},
		{name: "exponent label", spec: "numeric", label: str("1e3"), answer: "1000", want: 1},
		{name: "no number", spec: "numeric", label: str("42"), answer: "I don't know", want: 0},
		{name: "marker without number", spec: "numeric", label: str("42"), answer: "42\n#### forty-two", want: 0},
		{name: "label not a number", spec: "numeric", label: str("forty-two"), answer: "42", wantErr: `"forty-two" is not a number`},
		{name: "label inf rejected", spec: "numeric", label: str("inf"), answer: "42", wantErr: "is not a number"},
		{name: "label nan rejected", spec: "numeric", label: str("NaN"), answer: "42", wantErr: "is not a number"},
		{name: "label overflow rejected", spec: "numeric", label: str("1e999"), answer: "42", wantErr: "is not a number"},
		{name: "missing label", spec: "numeric", answer: "42", wantErr: "numeric: no label"},
	})
}

func TestRegex(t *testing.T) {
	runCases(t, []gradeCase{
		{name: "label pattern", spec: "regex", label: str(`^\d+$`), answer: "42", want: 1},
		{name: "searched not anchored", spec: "regex", label: str(`ans(wer)?: 4\d`), answer: "final answer: 42!", want: 1},
		{name: "no match", spec: "regex", label: str(`^\d+$`), answer: "42 apples", want: 0},
		{name: "label trimmed", spec: "regex", label: str("^42$\n"), answer: "42", want: 1},
		{name: "pattern param overrides label", spec: `regex:pattern=(?i)^yes$`, label: str("no"), answer: "YES", want: 1},
		{name: "pattern param without label", spec: `regex:pattern=a{1,3}b`, answer: "xaab", want: 1},
		{name: "pattern with comma continues", spec: `regex:pattern=^a{2,3}$`, answer: "aaaa", want: 0},
		{name: "invalid label regex", spec: "regex", label: str("a(b"), answer: "ab", wantErr: `invalid regular expression "a(b"`},
		{name: "missing label", spec: "regex", answer: "x", wantErr: "regex: no label"},
	})
}

func TestCalculatorGrader(t *testing.T) {
	runCases(t, []gradeCase{
		{name: "contains ground truth", spec: "calculator", label: str("42"), answer: "6 * 7 = 42", want: 1},
		{name: "label trimmed", spec: "calculator", label: str("42\n"), answer: "It is 42.", want: 1},
		{name: "gsm8k label", spec: "calculator", label: str("6*7\n#### 42"), answer: "42", want: 1},
		{name: "marker numeric equal", spec: "calculator", label: str("42"), answer: "#### 42.0", want: 1},
		{name: "wrong", spec: "calculator", label: str("42"), answer: "41", want: 0},
		{name: "missing label", spec: "calculator", answer: "42", wantErr: "calculator: no label"},
		{name: "blank label", spec: "calculator", label: str(" "), answer: "42", wantErr: "label is blank"},
	})
}

func TestCalculatorFunc(t *testing.T) {
	tests := []struct {
		solution, truth string
		want            float64
		wantErr         bool
	}{
		{"The answer is 42", "42", 1, false},
		{"The answer is 41", "42", 0, false},
		{"#### 1,000", "1000", 1, false},
		{"1000", "#### 1,000", 0, false},
		{"", "42", 0, false},
		{"anything", "   ", 0, true},
		{"anything", "work\n####", 0, true},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%q vs %q", tc.solution, tc.truth), func(t *testing.T) {
			got, err := graders.Calculator(tc.solution, tc.truth, nil)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tc.wantErr)
			}
			if got != tc.want {
				t.Fatalf("reward = %v, want %v", got, tc.want)
			}
		})
	}
}

// Every sample of a rollout is scored, not just the first.
func TestGradersScoreEverySample(t *testing.T) {
	for _, name := range graders.Names() {
		t.Run(name, func(t *testing.T) {
			g, err := graders.Lookup(name)
			if err != nil {
				t.Fatal(err)
			}
			label := "42"
			if name == "regex" {
				label = "^42$"
			}
			gc := osmotest.NewGraderContext("r", []*osmo.Sample{
				{ID: "right", Messages: []osmo.Message{{"role": "assistant", "content": "42"}}},
				{ID: "wrong", Messages: []osmo.Message{{"role": "assistant", "content": "17"}}},
				{ID: "parts", Messages: []osmo.Message{{"role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "42"}}}}},
			}, &label, nil)
			if name == "answer" {
				for _, s := range gc.Samples {
					s.Messages[0]["content"] = "#### " + osmo.LastAssistantText(s.Messages)
				}
			}
			if err := g.Grade(context.Background(), gc); err != nil {
				t.Fatal(err)
			}
			if left := gc.Ungraded(); len(left) != 0 {
				t.Fatalf("ungraded: %v", left)
			}
			for id, want := range map[string]float64{"right": 1, "wrong": 0, "parts": 1} {
				if r, _ := gc.Reward(id); r != want {
					t.Errorf("%s: reward %v, want %v", id, r, want)
				}
			}
		})
	}
}

func TestGradersStopOnCancelledContext(t *testing.T) {
	g, err := graders.Lookup("exact")
	if err != nil {
		t.Fatal(err)
	}
	label := "x"
	gc := osmotest.NewGraderContext("r", []*osmo.Sample{{ID: "a"}}, &label, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := g.Grade(ctx, gc); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestNames(t *testing.T) {
	want := []string{"answer", "calculator", "contains", "exact", "multiply", "numeric", "regex"}
	if got := graders.Names(); !slices.Equal(got, want) {
		t.Fatalf("Names() = %v, want %v", got, want)
	}
}

func TestLookupErrors(t *testing.T) {
	tests := []struct {
		spec     string
		sentinel error
		want     []string // substrings of the message
	}{
		{"", graders.ErrInvalidSpec, []string{"no grader name", "known: answer, calculator"}},
		{"nope", graders.ErrUnknownGrader, []string{`"nope"`, "known: answer, calculator, contains, exact, multiply, numeric, regex"}},
		{":rel=1", graders.ErrInvalidSpec, []string{"no grader name"}},
		{"numeric:", graders.ErrInvalidSpec, []string{"no parameters after ':'"}},
		{"numeric:rel", graders.ErrInvalidSpec, []string{`parameter "rel" is not key=value`}},
		{"numeric:=1", graders.ErrInvalidSpec, []string{"has no name"}},
		{"numeric:rel=1,rel=2", graders.ErrInvalidSpec, []string{`"rel" given twice`}},
		{"numeric:tol=1", graders.ErrInvalidSpec, []string{`unknown parameter "tol"`, "known: abs, rel"}},
		{"numeric:rel=abc", graders.ErrInvalidSpec, []string{`parameter "rel"`, `"abc"`}},
		{"numeric:abs=-1", graders.ErrInvalidSpec, []string{`parameter "abs"`}},
		{"numeric:rel=NaN", graders.ErrInvalidSpec, []string{`parameter "rel"`}},
		{"exact:x=1", graders.ErrInvalidSpec, []string{`unknown parameter "x"`, "it takes none"}},
		{"regex:pattern=a(b", graders.ErrInvalidSpec, []string{`parameter "pattern"`, `invalid regular expression "a(b"`}},
		{"regex:pattern=", graders.ErrInvalidSpec, []string{`parameter "pattern"`, "empty pattern"}},
	}
	for _, tc := range tests {
		t.Run(tc.spec, func(t *testing.T) {
			g, err := graders.Lookup(tc.spec)
			if err == nil {
				t.Fatalf("Lookup(%q) = %v, want an error", tc.spec, g)
			}
			if !errors.Is(err, tc.sentinel) {
				t.Errorf("error %v does not wrap %v", err, tc.sentinel)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestLookupAcceptsEveryName(t *testing.T) {
	for _, name := range graders.Names() {
		if _, err := graders.Lookup(" " + name + " "); err != nil {
			t.Errorf("Lookup(%q): %v", name, err)
		}
	}
}

func ExampleLookup() {
	g, err := graders.Lookup("numeric:rel=0.01")
	if err != nil {
		fmt.Println(err)
		return
	}
	label := "3.14"
	gc := osmotest.NewGraderContext("rollout-1", []*osmo.Sample{
		{ID: "agent", Messages: []osmo.Message{{"role": "assistant", "content": "Pi is roughly 3.1416."}}},
	}, &label, nil)
	if err := g.Grade(context.Background(), gc); err != nil {
		fmt.Println(err)
		return
	}
	r, _ := gc.Reward("agent")
	fmt.Println(r)
	// Output: 1
}
