package osmoopenai

import (
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"
)

// TestRequestBody holds requestBody to what openai-go writes for the same
// params with the items as their messages, for params with and without
// tools, with extra fields and made with param.Override.
func TestRequestBody(t *testing.T) {
	items := []json.RawMessage{
		json.RawMessage(`{"role":"system","content":"be brief"}`),
		json.RawMessage(`{"role":"user","content":"What is 6 times 7? <&>"}`),
		json.RawMessage(`{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}`),
		json.RawMessage(`{"role":"tool","tool_call_id":"c1","content":"42"}`),
	}
	tool := Tool{Name: "multiply", Description: "Multiply two integers.", Parameters: map[string]any{
		"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
	}}
	withExtras := openai.ChatCompletionNewParams{Model: "m"}
	withExtras.SetExtraFields(map[string]any{"chat_template_kwargs": map[string]any{"enable_thinking": false}})
	cases := map[string]openai.ChatCompletionNewParams{
		"model only":  {Model: "m"},
		"nothing":     {},
		"sampling":    {Model: "m", Temperature: openai.Float(0.5), MaxTokens: openai.Int(7), Seed: openai.Int(3), Stop: openai.ChatCompletionNewParamsStopUnion{OfStringArray: []string{"\n"}}},
		"tools":       {Model: "m", Tools: []openai.ChatCompletionToolUnionParam{tool.param()}, ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}},
		"empty tools": {Model: "m", Tools: []openai.ChatCompletionToolUnionParam{}},
		"extra":       withExtras,
		"override":    param.Override[openai.ChatCompletionNewParams](json.RawMessage(`{"model":"raw","messages":[]}`)),
	}
	for name, params := range cases {
		t.Run(name, func(t *testing.T) {
			want := params
			want.Messages = messageOverrides(items)
			wantBody, err := json.Marshal(&want)
			if err != nil {
				t.Fatal(err)
			}
			for _, encoded := range []bool{false, true} {
				var enc *encodedParams
				if encoded && plain(&params) {
					if enc, err = encodeParams(&params); err != nil {
						t.Fatal(err)
					}
				}
				p := params
				got, err := requestBody(&p, items, enc)
				if err != nil {
					t.Fatal(err)
				}
				var gotV, wantV any
				if err := json.Unmarshal(got, &gotV); err != nil {
					t.Fatalf("not JSON: %s", got)
				}
				if err := json.Unmarshal(wantBody, &wantV); err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(gotV, wantV) {
					t.Errorf("tools encoded before: %v\n got %s\nwant %s", encoded, got, wantBody)
				}
				if !reflect.DeepEqual(p.Tools, params.Tools) || p.Messages != nil {
					t.Errorf("params changed: tools %v, messages %v", p.Tools, p.Messages)
				}
			}
		})
	}
}

// BenchmarkRequestBody compares requestBody with openai-go's encoding of
// the same params, at the second turn of a tool-calling conversation.
func BenchmarkRequestBody(b *testing.B) {
	items := []json.RawMessage{
		json.RawMessage(`{"role":"system","content":"Use the multiply tool when arithmetic is required."}`),
		json.RawMessage(`{"role":"user","content":"What is 6 times 7?"}`),
		json.RawMessage(`{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}`),
		json.RawMessage(`{"role":"tool","tool_call_id":"c1","content":"42"}`),
	}
	tool := Tool{Name: "multiply", Description: "Multiply two integers.", Parameters: map[string]any{
		"type": "object", "properties": map[string]any{"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
		"required": []any{"a", "b"}, "additionalProperties": false,
	}}
	params := openai.ChatCompletionNewParams{Model: Model, Temperature: openai.Float(1), MaxTokens: openai.Int(4096),
		Tools: []openai.ChatCompletionToolUnionParam{tool.param()}}
	enc, err := encodeParams(&params)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("requestBody", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := requestBody(&params, items, enc); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("openai-go", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			p := params
			p.Messages = messageOverrides(items)
			if _, err := json.Marshal(&p); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestTextMessageParam holds the params built directly for a role and a
// string content to what decoding the message gives.
func TestTextMessageParam(t *testing.T) {
	for _, role := range []string{"system", "user", "developer", "assistant"} {
		m := map[string]any{"role": role, "content": "6 × 7 <is> \"42\""}
		got, ok := textMessageParam(role, m)
		if !ok {
			t.Fatalf("%s: not built directly", role)
		}
		in, _ := json.Marshal(m)
		var want openai.ChatCompletionMessageParamUnion
		if err := json.Unmarshal(in, &want); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: built %+v, decoded %+v", role, got, want)
		}
	}
	for _, m := range []map[string]any{
		{"role": "tool", "content": "42"},
		{"role": "user", "content": "hi", "name": "ann"},
		{"role": "user", "content": []any{}},
	} {
		if _, ok := textMessageParam(m["role"].(string), m); ok {
			t.Errorf("%v: built directly", m)
		}
	}
}

// TestReadBody: a body read into a buffer of its Content-Length is read
// whole, one shorter than it says is an error (not a reply cut short), and
// a body of unknown length or claiming more than presizeMax is read as it
// comes.
func TestReadBody(t *testing.T) {
	for _, tc := range []struct {
		name    string
		body    string
		length  int64
		wantErr bool
	}{
		{"its length", `{"id":"x"}`, 10, false},
		{"unknown length", `{"id":"x"}`, -1, false},
		{"shorter than it says", `{"id":"x"}`, 20, true},
		{"a length not trusted", `{"id":"x"}`, presizeMax + 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := readBody(&http.Response{Body: io.NopCloser(strings.NewReader(tc.body)), ContentLength: tc.length})
			if tc.wantErr {
				if err == nil {
					t.Fatalf("read %q, want an error", got)
				}
				return
			}
			if err != nil || string(got) != tc.body {
				t.Fatalf("read %q, %v; want %q", got, err, tc.body)
			}
		})
	}
}
