// Package graders provides the built-in graders of the grader service,
// selectable by a spec string such as "exact" or "numeric:rel=1e-3".
//
// Every built-in scores each sample's last assistant text
// (osmo.LastAssistantText) against the rollout's label and sets a reward of
// 1 or 0. A rollout without a label, or with a blank one, is an error: a
// grader that cannot tell right from wrong must say so rather than answer 0.
//
//	exact       the trimmed answer equals the trimmed label
//	contains    the trimmed label occurs in the answer
//	answer      GSM8K style: the text after the last "####" in the answer equals
//	            the label (or the label's own "####" part), textually or as numbers
//	numeric     the answer's number (after "####", else the last number in the
//	            text) equals the label within tolerance; params rel, abs
//	regex       the trimmed label, or the pattern= param, is a Go regular expression
//	            found in the answer
//	calculator  the answer contains the ground truth (the label, or its "####"
//	            part), or its own "####" part equals it
//	multiply    the multiply example's grader: 1 when the trimmed label occurs in the
//	            answer, else 0; a missing or blank label scores 0 (not an error)
package graders

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/osmo-rl/osmo"
)

// ErrUnknownGrader is wrapped by Lookup errors for names it does not know.
var ErrUnknownGrader = errors.New("unknown grader")

// ErrInvalidSpec is wrapped by Lookup errors for malformed specs and bad
// parameters.
var ErrInvalidSpec = errors.New("invalid grader spec")

// builtin describes one grader: the parameters it accepts and how to build it
// from their values.
type builtin struct {
	params []string
	build  func(p params) (osmo.Grader, error)
}

// builtins is a function rather than a package variable so the table cannot
// be changed by anyone at run time.
func builtins() map[string]builtin {
	return map[string]builtin{
		"exact": {build: func(params) (osmo.Grader, error) {
			return labelGrader("exact", func(label string) (scorer, error) {
				label = strings.TrimSpace(label)
				return func(answer string) bool { return strings.TrimSpace(answer) == label }, nil
			}), nil
		}},
		"contains": {build: func(params) (osmo.Grader, error) {
			return labelGrader("contains", func(label string) (scorer, error) {
				label = strings.TrimSpace(label)
				return func(answer string) bool { return strings.Contains(answer, label) }, nil
			}), nil
		}},
		"answer": {build: func(params) (osmo.Grader, error) {
			return labelGrader("answer", prepareAnswer), nil
		}},
		"numeric": {params: []string{"abs", "rel"}, build: buildNumeric},
		"regex":   {params: []string{"pattern"}, build: buildRegex},
		"calculator": {build: func(params) (osmo.Grader, error) {
			reward := osmo.RewardGrader(Calculator)
			return osmo.GraderFunc(func(ctx context.Context, gc *osmo.GraderContext) error {
				if _, err := requireLabel(gc); err != nil {
					return fmt.Errorf("graders: calculator: %w", err)
				}
				if err := reward.Grade(ctx, gc); err != nil {
					return fmt.Errorf("graders: calculator: %w", err)
				}
				return nil
			}), nil
		}},
		"multiply": {build: func(params) (osmo.Grader, error) { return MultiplyGrader{}, nil }},
	}
}

// Names lists the built-in graders, sorted.
func Names() []string {
	b := builtins()
	names := make([]string, 0, len(b))
	for n := range b {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Lookup builds the grader a spec names. A spec is "name" or
// "name:key=value,key=value". Values run to the next comma that starts a new
// key=value pair, so "regex:pattern=a{1,3}" keeps its comma. Unknown names and
// parameters, and values that do not parse, are errors naming them.
func Lookup(spec string) (osmo.Grader, error) {
	name, p, err := parseSpec(spec)
	if err != nil {
		return nil, err
	}
	b, ok := builtins()[name]
	if !ok {
		return nil, fmt.Errorf("graders: %w %q (known: %s)", ErrUnknownGrader, name, strings.Join(Names(), ", "))
	}
	for k := range p {
		if !slices.Contains(b.params, k) {
			known := "it takes none"
			if len(b.params) > 0 {
				known = "known: " + strings.Join(b.params, ", ")
			}
			return nil, fmt.Errorf("graders: %s: %w: unknown parameter %q (%s)", name, ErrInvalidSpec, k, known)
		}
	}
	g, err := b.build(p)
	if err != nil {
		return nil, fmt.Errorf("graders: %s: %w: %w", name, ErrInvalidSpec, err)
	}
	return g, nil
}

// params are the key=value pairs of a spec.
type params map[string]string

func parseSpec(spec string) (string, params, error) {
	name, rest, hasParams := strings.Cut(strings.TrimSpace(spec), ":")
	name = strings.TrimSpace(name)
	if name == "" {
		return "", nil, fmt.Errorf("graders: %w %q: no grader name (known: %s)", ErrInvalidSpec, spec, strings.Join(Names(), ", "))
	}
	p := params{}
	if !hasParams {
		return name, p, nil
	}
	if strings.TrimSpace(rest) == "" {
		return "", nil, fmt.Errorf("graders: %s: %w: no parameters after ':'", name, ErrInvalidSpec)
	}
	last := ""
	for _, part := range strings.Split(rest, ",") {
		k, v, ok := strings.Cut(part, "=")
		if !ok {
			// A comma inside a value (a{1,3}) continues the previous one.
			if last == "" {
				return "", nil, fmt.Errorf("graders: %s: %w: parameter %q is not key=value", name, ErrInvalidSpec, part)
			}
			p[last] += "," + part
			continue
		}
		k = strings.TrimSpace(k)
		if k == "" {
			return "", nil, fmt.Errorf("graders: %s: %w: parameter %q has no name", name, ErrInvalidSpec, part)
		}
		if _, dup := p[k]; dup {
			return "", nil, fmt.Errorf("graders: %s: %w: parameter %q given twice", name, ErrInvalidSpec, k)
		}
		p[k] = v
		last = k
	}
	return name, p, nil
}

// float reads parameter key as a finite, non-negative number.
func (p params) float(key string, def float64) (float64, error) {
	v, ok := p[key]
	if !ok {
		return def, nil
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f < 0 {
		return 0, fmt.Errorf("parameter %q: want a finite number >= 0, got %q", key, v)
	}
	return f, nil
}

// scorer decides whether one answer is right.
type scorer func(answer string) bool

// labelGrader builds a grader that scores every sample's last assistant
// text with the scorer prepare makes from the label. prepare runs once per
// rollout, so a label that cannot be used fails the rollout before any
// sample is scored.
func labelGrader(name string, prepare func(label string) (scorer, error)) osmo.Grader {
	return osmo.GraderFunc(func(ctx context.Context, gc *osmo.GraderContext) error {
		label, err := requireLabel(gc)
		if err != nil {
			return fmt.Errorf("graders: %s: %w", name, err)
		}
		score, err := prepare(label)
		if err != nil {
			return fmt.Errorf("graders: %s: label: %w", name, err)
		}
		return scoreSamples(ctx, name, gc, score)
	})
}

func scoreSamples(ctx context.Context, name string, gc *osmo.GraderContext, score scorer) error {
	ids := make([]string, 0, len(gc.Samples))
	for id := range gc.Samples {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("graders: %s: %w", name, err)
		}
		reward := 0.0
		if score(osmo.LastAssistantText(gc.Samples[id].Messages)) {
			reward = 1
		}
		if err := gc.SetSampleReward(id, reward); err != nil {
			return fmt.Errorf("graders: %s: %w", name, err)
		}
	}
	return nil
}

func requireLabel(gc *osmo.GraderContext) (string, error) {
	if gc.Label == nil {
		return "", errors.New("no label: this grader needs the row's ground truth")
	}
	if strings.TrimSpace(*gc.Label) == "" {
		return "", errors.New("label is blank: this grader needs the row's ground truth")
	}
	return *gc.Label, nil
}

// prepareAnswer is the GSM8K comparison: final answers after "####".
func prepareAnswer(label string) (scorer, error) {
	want := strings.TrimSpace(label)
	if after, ok := finalAnswer(label); ok {
		want = after
	}
	if want == "" {
		return nil, errors.New(`nothing after "####"`)
	}
	return func(answer string) bool {
		got, ok := finalAnswer(answer)
		return ok && sameAnswer(got, want)
	}, nil
}

// sameAnswer compares two final answers as text, then as numbers, so "42"
// matches "42.0" and "1,000" matches "1000".
func sameAnswer(got, want string) bool {
	if got == want {
		return true
	}
	g, gok := parseNumber(got)
	w, wok := parseNumber(want)
	return gok && wok && g == w
}

func buildNumeric(p params) (osmo.Grader, error) {
	rel, err := p.float("rel", 1e-6)
	if err != nil {
		return nil, err
	}
	abs, err := p.float("abs", 1e-9)
	if err != nil {
		return nil, err
	}
	return labelGrader("numeric", func(label string) (scorer, error) {
		want, ok := parseNumber(label)
		if !ok {
			return nil, fmt.Errorf("%q is not a number", strings.TrimSpace(label))
		}
		return func(answer string) bool {
			got, ok := answerNumber(answer)
			return ok && within(got, want, rel, abs)
		}, nil
	}), nil
}

// answerNumber is the number an answer gives: the first number after the
// last "####" when there is one (the marker introduces the final answer,
// which may be followed by units or an explanation), else the last number in
// the text (models state the result last).
func answerNumber(answer string) (float64, bool) {
	if after, ok := finalAnswer(answer); ok {
		nums := numbersIn(after)
		if len(nums) == 0 {
			return 0, false
		}
		return nums[0], true
	}
	nums := numbersIn(answer)
	if len(nums) == 0 {
		return 0, false
	}
	return nums[len(nums)-1], true
}

// within reports |a-b| <= max(abs, rel*max(|a|,|b|)).
func within(a, b, rel, abs float64) bool {
	d := math.Abs(a - b)
	return d <= abs || d <= rel*math.Max(math.Abs(a), math.Abs(b))
}

func buildRegex(p params) (osmo.Grader, error) {
	if pat, ok := p["pattern"]; ok {
		re, err := regexp.Compile(pat)
		if err != nil {
			return nil, fmt.Errorf("parameter %q: invalid regular expression %q: %w", "pattern", pat, err)
		}
		if pat == "" {
			return nil, fmt.Errorf("parameter %q: empty pattern matches everything", "pattern")
		}
		// The pattern stands in for the label, so no label is needed.
		return osmo.GraderFunc(func(ctx context.Context, gc *osmo.GraderContext) error {
			return scoreSamples(ctx, "regex", gc, re.MatchString)
		}), nil
	}
	return labelGrader("regex", func(label string) (scorer, error) {
		pat := strings.TrimSpace(label)
		re, err := regexp.Compile(pat)
		if err != nil {
			return nil, fmt.Errorf("invalid regular expression %q: %w", pat, err)
		}
		return re.MatchString, nil
	}), nil
}
