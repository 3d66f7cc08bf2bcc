package osmoopenai

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"
	"github.com/openai/openai-go/v3/shared"
)

// multiplyTool is the multiply workflow's tool, as its schema is written.
var multiplyTool = Tool{Name: "multiply", Description: "Multiply two integers.", Parameters: map[string]any{
	"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
	"required": []any{"a", "b"}, "additionalProperties": false,
}}

// offered is params with tools offered as offer offers them.
func offered(params openai.ChatCompletionNewParams, tools ...Tool) openai.ChatCompletionNewParams {
	for _, t := range tools {
		params.Tools = append(params.Tools, t.param())
	}
	return params
}

// TestWriteParamsIsOpenAI holds writeParams to openai-go's encoding of the
// same params, byte for byte, for every field it writes (each alone, and
// random mixes of them) and for tools of many schemas.
func TestWriteParamsIsOpenAI(t *testing.T) {
	odd := Tool{Name: "a<b>&c", Description: "line\u2028sep \"quoted\" \\ \x01", Parameters: map[string]any{
		"type": "object", "z": 1.5e300, "small": 1e-7, "int": 3, "i64": int64(-4), "nil slice": []any(nil), "nil map": map[string]any(nil), "nil strings": []string(nil),
		"enum": []string{"x", "<y>"}, "nested": map[string]any{"deep": []any{nil, true, "s", 2.5, map[string]any{}}},
	}}
	bare := Tool{Name: "noargs"}
	empty := Tool{Name: "empty", Parameters: map[string]any{}}

	cases := map[string]openai.ChatCompletionNewParams{
		"nothing":          {},
		"no tools":         {Model: "m", Tools: []openai.ChatCompletionToolUnionParam{}},
		"multiply":         offered(openai.ChatCompletionNewParams{Model: Model, Temperature: openai.Float(1), MaxTokens: openai.Int(4096)}, multiplyTool),
		"odd tools":        offered(openai.ChatCompletionNewParams{Model: "m<&>"}, odd, bare, empty),
		"false and zero":   {Logprobs: openai.Bool(false), Temperature: openai.Float(0), Seed: openai.Int(0), User: openai.String("")},
		"negative zero":    {TopP: openai.Float(math.Copysign(0, -1))},
		"enums":            {ReasoningEffort: shared.ReasoningEffortHigh, ServiceTier: openai.ChatCompletionNewParamsServiceTierFlex, Verbosity: openai.ChatCompletionNewParamsVerbosityLow, PromptCacheRetention: "24h"},
		"value, no status": {Temperature: param.Opt[float64]{Value: 0.7}},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	floats := []float64{0, 1, 0.5, 1.0 / 3, 1e21, 1e-7, -2, 123456.789}
	for i := range 200 {
		p := openai.ChatCompletionNewParams{}
		pick := func() bool { return rng.IntN(3) == 0 }
		f := func() param.Opt[float64] { return openai.Float(floats[rng.IntN(len(floats))]) }
		n := func() param.Opt[int64] { return openai.Int(rng.Int64N(1<<40) - 1<<39) }
		b := func() param.Opt[bool] { return openai.Bool(rng.IntN(2) == 0) }
		s := func() param.Opt[string] { return openai.String([]string{"", "x", "<é>", "a\"b"}[rng.IntN(4)]) }
		if pick() {
			p.Model = "model-" + string(rune('a'+rng.IntN(26)))
		}
		for _, set := range []func(){
			func() { p.FrequencyPenalty = f() }, func() { p.PresencePenalty = f() }, func() { p.Temperature = f() }, func() { p.TopP = f() },
			func() { p.MaxCompletionTokens = n() }, func() { p.MaxTokens = n() }, func() { p.N = n() }, func() { p.Seed = n() }, func() { p.TopLogprobs = n() },
			func() { p.Logprobs = b() }, func() { p.Store = b() }, func() { p.ParallelToolCalls = b() },
			func() { p.PromptCacheKey = s() }, func() { p.SafetyIdentifier = s() }, func() { p.User = s() },
			func() { p.ReasoningEffort = shared.ReasoningEffortMinimal }, func() { p.ServiceTier = "auto" }, func() { p.Verbosity = "high" },
		} {
			if pick() {
				set()
			}
		}
		var tools []Tool
		if pick() {
			tools = []Tool{multiplyTool, odd}[:1+rng.IntN(2)]
		}
		cases["random "+string(rune('A'+i%26))+string(rune('a'+i/26))] = offered(p, tools...)
	}

	for name, params := range cases {
		var own []Tool
		for _, u := range params.Tools {
			for _, t := range []Tool{multiplyTool, odd, bare, empty} {
				if u.OfFunction.Function.Name == t.Name {
					own = append(own, t)
				}
			}
		}
		want, err := encodeParamsHere(&params)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got := writeParams(&params, own)
		if got == nil {
			t.Errorf("%s: declined", name)
			continue
		}
		if !bytes.Equal(got.rest, want.rest) || !bytes.Equal(got.tools, want.tools) {
			t.Errorf("%s:\n got %s %s\nwant %s %s", name, got.rest, got.tools, want.rest, want.tools)
		}
	}
}

// TestWriteParamsDeclines: what it does not write is left to openai-go.
func TestWriteParamsDeclines(t *testing.T) {
	type custom struct{ A int }
	cases := map[string]struct {
		params openai.ChatCompletionNewParams
		own    []Tool
	}{
		"null":          {params: openai.ChatCompletionNewParams{Temperature: param.Null[float64]()}},
		"NaN":           {params: openai.ChatCompletionNewParams{Temperature: openai.Float(math.NaN())}},
		"infinity":      {params: openai.ChatCompletionNewParams{TopP: openai.Float(math.Inf(1))}},
		"stop":          {params: openai.ChatCompletionNewParams{Stop: openai.ChatCompletionNewParamsStopUnion{OfString: openai.String("\n")}}},
		"metadata":      {params: openai.ChatCompletionNewParams{Metadata: shared.Metadata{"k": "v"}}},
		"tool choice":   {params: offered(openai.ChatCompletionNewParams{ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}}, multiplyTool), own: []Tool{multiplyTool}},
		"caller's tool": {params: offered(openai.ChatCompletionNewParams{}, multiplyTool)},
		"struct schema": {params: offered(openai.ChatCompletionNewParams{}, Tool{Name: "s", Parameters: map[string]any{"x": custom{1}}}), own: []Tool{{Name: "s", Parameters: map[string]any{"x": custom{1}}}}},
		"NaN schema":    {params: offered(openai.ChatCompletionNewParams{}, Tool{Name: "n", Parameters: map[string]any{"x": math.NaN()}}), own: []Tool{{Name: "n", Parameters: map[string]any{"x": math.NaN()}}}},
		"json.Number":   {params: offered(openai.ChatCompletionNewParams{}, Tool{Name: "n", Parameters: map[string]any{"x": json.Number("1")}}), own: []Tool{{Name: "n", Parameters: map[string]any{"x": json.Number("1")}}}},
	}
	for name, c := range cases {
		if enc := writeParams(&c.params, c.own); enc != nil {
			t.Errorf("%s: written: %s %s", name, enc.rest, enc.tools)
		}
	}
}

// BenchmarkWriteParams compares writeParams with openai-go's encoding, for
// the multiply workflow's params and tool.
func BenchmarkWriteParams(b *testing.B) {
	params := offered(openai.ChatCompletionNewParams{Model: Model, Temperature: openai.Float(1), MaxTokens: openai.Int(4096)}, multiplyTool)
	own := []Tool{multiplyTool}
	b.Run("writeParams", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if writeParams(&params, own) == nil {
				b.Fatal("declined")
			}
		}
	})
	b.Run("openai-go", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := encodeParamsHere(&params); err != nil {
				b.Fatal(err)
			}
		}
	})
}
