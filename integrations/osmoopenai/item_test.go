package osmoopenai

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"
)

// assistant builds an assistant message param of content (nil: none) and
// function calls given as id, name, arguments triples.
func assistant(content *string, calls ...[3]string) openai.ChatCompletionMessageParamUnion {
	a := openai.ChatCompletionAssistantMessageParam{}
	if content != nil {
		a.Content.OfString = openai.String(*content)
	}
	for _, c := range calls {
		a.ToolCalls = append(a.ToolCalls, openai.ChatCompletionMessageToolCallUnionParam{OfFunction: &openai.ChatCompletionMessageFunctionToolCallParam{
			ID: c[0], Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: c[1], Arguments: c[2]},
		}})
	}
	return openai.ChatCompletionMessageParamUnion{OfAssistant: &a}
}

// TestAppendItem: the messages appendItem writes are byte for byte what
// openai-go writes, and it declines every param whose encoding depends on
// more than it reads.
func TestAppendItem(t *testing.T) {
	text, empty := "6 times 7 is <42> & \"done\"\n", ""
	written := map[string]openai.ChatCompletionMessageParamUnion{
		"system":                openai.SystemMessage("Use the multiply tool."),
		"developer":             openai.DeveloperMessage("d"),
		"user":                  openai.UserMessage("What is 6 times 7? \u2028 \xff"),
		"user, empty":           openai.UserMessage(""),
		"tool":                  openai.ToolMessage("42", "call_1"),
		"tool, empty id":        openai.ToolMessage("Error: bad", ""),
		"assistant text":        assistant(&text),
		"assistant empty text":  assistant(&empty),
		"assistant calls":       assistant(nil, [3]string{"call_1", "multiply", `{"a":6,"b":7}`}, [3]string{"call_2", "add", ""}),
		"assistant text, calls": assistant(&text, [3]string{"c", "multiply", `{"a":"<x>"}`}),
		"assistant nothing":     assistant(nil),
		"call of no function":   assistant(nil, [3]string{"c", "", ""}, [3]string{"d", "", "{}"}),
		"reply as param":        replyParam(&openai.ChatCompletionMessage{Content: "hi", Role: "assistant"}),
		"empty reply as param":  replyParam(&openai.ChatCompletionMessage{Role: "assistant"}),
	}
	named := openai.ChatCompletionUserMessageParam{Name: openai.String("bob")}
	named.Content.OfString = openai.String("hi")
	extra := openai.ChatCompletionToolMessageParam{ToolCallID: "c"}
	extra.Content.OfString = openai.String("42")
	extra.SetExtraFields(map[string]any{"cache": true})
	refusal := openai.ChatCompletionAssistantMessageParam{Refusal: openai.String("no")}
	custom := openai.ChatCompletionAssistantMessageParam{ToolCalls: []openai.ChatCompletionMessageToolCallUnionParam{{
		OfCustom: &openai.ChatCompletionMessageCustomToolCallParam{ID: "c", Custom: openai.ChatCompletionMessageCustomToolCallCustomParam{Name: "n", Input: "i"}},
	}}}
	callExtra := assistant(nil, [3]string{"c", "f", "{}"})
	callExtra.OfAssistant.ToolCalls[0].OfFunction.SetExtraFields(map[string]any{"index": 0})
	nullContent := openai.ChatCompletionSystemMessageParam{}
	nullContent.Content.OfString = param.Null[string]()
	declined := map[string]openai.ChatCompletionMessageParamUnion{
		"user with a name":       {OfUser: &named},
		"user of parts":          openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{openai.TextContentPart("hi")}),
		"tool with extra fields": {OfTool: &extra},
		"assistant with refusal": {OfAssistant: &refusal},
		"assistant custom call":  {OfAssistant: &custom},
		"call with extra fields": callExtra,
		"overridden":             param.Override[openai.ChatCompletionMessageParamUnion](json.RawMessage(`{"role":"user","content":"x"}`)),
		"two variants":           {OfUser: &named, OfTool: &extra},
		"none":                   {},
		"null content":           {OfSystem: &nullContent},
		"function message":       {OfFunction: &openai.ChatCompletionFunctionMessageParam{Name: "f", Content: openai.String("x")}},
		"system of another role": {OfSystem: &openai.ChatCompletionSystemMessageParam{Role: "root"}},
	}
	for name, item := range written {
		want, err := json.Marshal(item)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got, ok := appendItem([]byte("prefix"), &item)
		if !ok {
			t.Errorf("%s: declined, want %s", name, want)
			continue
		}
		if !bytes.Equal(got, append([]byte("prefix"), want...)) {
			t.Errorf("%s:\n got %s\nwant %s", name, got[len("prefix"):], want)
		}
	}
	for name, item := range declined {
		if got, ok := appendItem(nil, &item); ok {
			t.Errorf("%s: written as %s, want it left to openai-go", name, got)
		}
	}
}

// FuzzAppendItem: whatever the strings, a text message and an assistant
// message with a call are written as openai-go writes them.
func FuzzAppendItem(f *testing.F) {
	f.Add("What is 6 times 7?", "call_1", "multiply", `{"a":6,"b":7}`)
	f.Add("", "", "", "")
	f.Add("<\u2028\xff\"\\\x00>", "\t", "é", "\x7f")
	f.Fuzz(func(t *testing.T, content, id, name, args string) {
		for _, item := range []openai.ChatCompletionMessageParamUnion{
			openai.UserMessage(content), openai.ToolMessage(content, id),
			assistant(&content, [3]string{id, name, args}), assistant(nil, [3]string{id, name, args}),
		} {
			want, err := json.Marshal(item)
			if err != nil {
				t.Fatal(err)
			}
			got, ok := appendItem(nil, &item)
			if !ok || !bytes.Equal(got, want) {
				t.Errorf("appendItem = %s (%v), want %s", got, ok, want)
			}
		}
	})
}

// BenchmarkEncodeItem: a turn's items through appendItem and through
// json.Marshal (openai-go's encoding).
func BenchmarkEncodeItem(b *testing.B) {
	text := "6 times 7 is 42."
	items := []openai.ChatCompletionMessageParamUnion{
		openai.SystemMessage("Use the multiply tool when arithmetic is required."), openai.UserMessage("What is 6 times 7?"),
		assistant(nil, [3]string{"call_1", "multiply", `{"a":6,"b":7}`}), openai.ToolMessage("42", "call_1"), assistant(&text),
	}
	b.Run("appendItem", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			for i := range items {
				_, _ = encodeItem(items[i])
			}
		}
	})
	b.Run("json.Marshal", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			for i := range items {
				_, _ = json.Marshal(items[i])
			}
		}
	})
}

// TestReplyParamIsToParam holds replyParam to what openai-go's ToParam
// makes of a reply's message (an explicit empty content added where it
// has nothing else), for messages of every part ToParam carries.
func TestReplyParamIsToParam(t *testing.T) {
	messages := []string{
		`{"role":"assistant","content":"6 × 7 = 42"}`,
		`{"role":"assistant","content":null}`,
		`{"role":"assistant","content":""}`,
		`{"role":"assistant","content":null,"refusal":"I can't help with that."}`,
		`{"role":"assistant","content":"calling","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}},{"id":"c2","type":"function","function":{"name":"multiply","arguments":""}}]}`,
		`{"role":"assistant","content":null,"tool_calls":[{"id":"c3","type":"custom","custom":{"name":"grep","input":"x <y> & z"}}]}`,
		`{"role":"assistant","content":null,"tool_calls":[{"id":"c4","type":"retrieval","retrieval":{}},{"id":"c5","function":{"name":"f","arguments":"{}"}}]}`,
		`{"role":"assistant","content":null,"function_call":{"name":"legacy","arguments":"{\"q\":1}"}}`,
		`{"role":"assistant","content":"spoken","audio":{"id":"audio_1","data":"AAAA","expires_at":1,"transcript":"spoken"}}`,
		`{"role":"assistant","content":"cited","annotations":[{"type":"url_citation","url_citation":{"end_index":1,"start_index":0,"title":"t","url":"https://example.com"}}],"extra":{"k":[1,2]}}`,
		`{"content":"no role","tool_calls":[]}`,
	}
	for _, raw := range messages {
		var m openai.ChatCompletionMessage
		if err := m.UnmarshalJSON([]byte(raw)); err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
		want := m.ToParam()
		if a := want.OfAssistant; !a.Content.OfString.Valid() && len(a.Content.OfArrayOfContentParts) == 0 &&
			len(a.ToolCalls) == 0 && a.FunctionCall.Name == "" && !a.Refusal.Valid() {
			a.Content.OfString = openai.String("")
		}
		got := replyParam(&m)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n got %+v\nwant %+v", raw, *got.OfAssistant, *want.OfAssistant)
		}
		gotItem, err := encodeItem(got)
		if err != nil {
			t.Fatal(err)
		}
		if wantItem, _ := encodeItem(want); !bytes.Equal(gotItem, wantItem) {
			t.Errorf("%s: item %s, want %s", raw, gotItem, wantItem)
		}
	}
}

// A reply decoded lean (for a turn of Run, or by RunText) gives the same
// next message, text and tool calls as openai-go's decode of it, and the
// same id and finish reason; a reply it cannot read so (no assistant role,
// a field of another type) is left to openai-go, and so is one without
// tool calls for a turn of Run (Run returns it).
func TestToolTurnDecodesAsOpenAI(t *testing.T) {
	reply := func(message string) []byte {
		return []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"tool_calls","logprobs":null,"message":` +
			message + `}],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}`)
	}
	read := []string{
		`{"role":"assistant","content":"calling","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}},{"id":"c2","type":"function","function":{"name":"multiply","arguments":""}}]}`,
		`{"role":"assistant","content":null,"tool_calls":[{"id":"c3","type":"custom","custom":{"name":"grep","input":"x <y> & z"}}]}`,
		`{"role":"assistant","content":null,"tool_calls":[{"id":"c4","type":"retrieval","retrieval":{}},{"id":"c5","function":{"name":"f","arguments":"{}"}}]}`,
		`{"role":"assistant","content":null,"refusal":"partly","tool_calls":[{"id":"c6","type":"function","function":{"name":"f","arguments":"{}"}}]}`,
		`{"role":"assistant","content":"spoken","audio":{"id":"audio_1","data":"AAAA","expires_at":1,"transcript":"spoken"},"function_call":{"name":"legacy","arguments":"{}"},"tool_calls":[{"id":"c7","type":"function","function":{"name":"f","arguments":"{}"}}],"annotations":[],"extra":{"k":[1,2]}}`,
		`{"role":"assistant","content":"\u00e9\ud83d\ude00 \\n","tool_calls":[{"id":"c8","type":"function","function":{"name":"f","arguments":"{\"s\":\"\\u00e9\"}"}}]}`,
	}
	// Final answers: read by RunText, left to openai-go by Run's turns.
	final := []string{
		`{"role":"assistant","content":"done"}`,
		`{"role":"assistant","content":null,"tool_calls":[]}`,
		`{"role":"assistant","content":"42","refusal":null,"annotations":[],"tool_calls":null}`,
		`{"role":"assistant","content":"\u00e9\ud83d\ude00 \\n"}`,
	}
	for _, m := range final {
		if _, ok := decodeLean(reply(m), true); ok {
			t.Errorf("%s: read for a tool turn, want it left to openai-go", m)
		}
	}
	for i, m := range append(read, final...) {
		body := reply(m)
		var want openai.ChatCompletion
		if err := want.UnmarshalJSON(body); err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		kept, ok := decodeLean(body, i < len(read))
		if !ok {
			t.Errorf("%s: not read lean", m)
			continue
		}
		got := &kept.c
		if got.ID != want.ID || len(got.Choices) != 1 || got.Choices[0].FinishReason != want.Choices[0].FinishReason {
			t.Errorf("%s: id %q, finish reason %q; want %q, %q", m, got.ID, got.Choices[0].FinishReason, want.ID, want.Choices[0].FinishReason)
		}
		gm, wm := &got.Choices[0].Message, &want.Choices[0].Message
		if gm.Content != wm.Content {
			t.Errorf("%s: content %q, want %q", m, gm.Content, wm.Content)
		}
		if g, w := replyParam(gm), replyParam(wm); !reflect.DeepEqual(g, w) {
			t.Errorf("%s:\n message %+v\n    want %+v", m, *g.OfAssistant, *w.OfAssistant)
		} else if gi, err := encodeItem(g); err != nil {
			t.Fatal(err)
		} else if wi, _ := encodeItem(w); !bytes.Equal(gi, wi) {
			t.Errorf("%s: item %s, want %s", m, gi, wi)
		}
		if g, w := toolCalls(gm.ToolCalls), toolCalls(wm.ToolCalls); !reflect.DeepEqual(g, w) {
			t.Errorf("%s: tool calls %+v, want %+v", m, g, w)
		}
		// Let go for the next reply's, which must not read anything of
		// this one's (the replies above differ field by field).
		kept.done()
	}
	for _, m := range []string{
		`{"content":"no role","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}`,
		`{"role":"assistant","content":[{"type":"text","text":"parts"}],"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}`,
		`{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":{"a":1}}}]}`,
		"{\"role\":\"assistant\",\"content\":\"a\xffb\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}",
	} {
		for _, needTools := range []bool{true, false} {
			if _, ok := decodeLean(reply(m), needTools); ok {
				t.Errorf("%s: read lean (needTools %v), want it left to openai-go", m, needTools)
			}
		}
	}
	if _, ok := decodeLean([]byte(`{"id":"x","choices":[]}`), false); ok {
		t.Error("a reply without choices was read for a tool turn")
	}
}
