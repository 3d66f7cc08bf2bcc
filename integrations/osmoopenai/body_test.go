package osmoopenai

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"
)

// TestRequestBodyIsTheParams holds the body a session writes to what
// openai-go encodes for the same params with the items as their messages.
func TestRequestBodyIsTheParams(t *testing.T) {
	items := []json.RawMessage{
		json.RawMessage(`{"role":"system","content":"Use the tool."}`),
		json.RawMessage(`{"role":"user","content":"6 x 7?","name":"u \"1\""}`),
	}
	tool := openai.ChatCompletionFunctionTool(openai.FunctionDefinitionParam{
		Name: "multiply", Parameters: openai.FunctionParameters{"type": "object"},
	})
	withExtra := openai.ChatCompletionNewParams{Model: "m"}
	withExtra.SetExtraFields(map[string]any{"return_token_ids": true})
	namesMessages := openai.ChatCompletionNewParams{Model: "m"}
	namesMessages.SetExtraFields(map[string]any{"messages": []any{}})
	cases := map[string]openai.ChatCompletionNewParams{
		"model only":       {Model: "m"},
		"nothing else":     {},
		"tools and fields": {Model: "m", Tools: []openai.ChatCompletionToolUnionParam{tool}, Temperature: openai.Float(0.5), MaxTokens: openai.Int(16), Stop: openai.ChatCompletionNewParamsStopUnion{OfStringArray: []string{"\n"}}},
		"extra fields":     withExtra,
		"extra messages":   namesMessages,
		"overridden":       param.Override[openai.ChatCompletionNewParams](json.RawMessage(`{"model":"x","messages":[]}`)),
	}
	for name, params := range cases {
		t.Run(name, func(t *testing.T) {
			var tools json.RawMessage
			if len(params.Tools) > 0 {
				var err error
				if tools, err = json.Marshal(params.Tools); err != nil {
					t.Fatal(err)
				}
			}
			got, err := requestBody(&params, items, tools)
			if err != nil {
				t.Fatal(err)
			}
			whole := params
			whole.Messages = requestMessages(items)
			want, err := whole.MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			var g, w any
			if err := json.Unmarshal(got, &g); err != nil {
				t.Fatalf("body %s: %v", got, err)
			}
			if err := json.Unmarshal(want, &w); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(g, w) {
				t.Errorf("body\n%s\nwant (as JSON)\n%s", got, want)
			}
		})
	}
}
