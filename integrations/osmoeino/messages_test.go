package osmoeino_test

//lint:file-ignore SA1019 the deprecated MultiContent parts are among the inputs the adapter must read.

import (
	"errors"
	"reflect"
	"testing"

	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoeino"
)

func ptr[T any](v T) *T { return &v }

func TestChatMessages(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   *schema.Message
		want string // the message as OpenAI chat JSON
	}{
		{name: "user text", in: schema.UserMessage("hi"), want: `{"role":"user","content":"hi"}`},
		{name: "system", in: schema.SystemMessage("be brief"), want: `{"role":"system","content":"be brief"}`},
		{name: "empty content stays a string", in: schema.AssistantMessage("", nil), want: `{"role":"assistant","content":""}`},
		{
			name: "assistant calling tools",
			in: schema.AssistantMessage("", []schema.ToolCall{
				{Index: ptr(0), ID: "call_1", Type: "function", Function: schema.FunctionCall{Name: "multiply", Arguments: `{"a":6,"b":7}`}},
				{ID: "call_2", Function: schema.FunctionCall{Name: "add", Arguments: `{"a":1,"b":2}`}},
			}),
			want: `{"role":"assistant","content":null,"tool_calls":[
				{"id":"call_1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}},
				{"id":"call_2","type":"function","function":{"name":"add","arguments":"{\"a\":1,\"b\":2}"}}]}`,
		},
		{
			name: "assistant text and a tool call",
			in:   schema.AssistantMessage("Let me compute.", []schema.ToolCall{{ID: "c", Function: schema.FunctionCall{Name: "multiply", Arguments: "{}"}}}),
			want: `{"role":"assistant","content":"Let me compute.","tool_calls":[{"id":"c","type":"function","function":{"name":"multiply","arguments":"{}"}}]}`,
		},
		{
			name: "tool result",
			in:   schema.ToolMessage("42", "call_1", schema.WithToolName("multiply")),
			want: `{"role":"tool","content":"42","tool_call_id":"call_1"}`,
		},
		{name: "named user", in: &schema.Message{Role: schema.User, Content: "hi", Name: "alice"}, want: `{"role":"user","content":"hi","name":"alice"}`},
		{
			name: "reasoning",
			in:   &schema.Message{Role: schema.Assistant, Content: "42", ReasoningContent: "6*7=42"},
			want: `{"role":"assistant","content":"42","reasoning_content":"6*7=42"}`,
		},
		{
			name: "user parts",
			in: &schema.Message{Role: schema.User, UserInputMultiContent: []schema.MessageInputPart{
				{Type: schema.ChatMessagePartTypeText, Text: "What is this?"},
				{Type: schema.ChatMessagePartTypeImageURL, Image: &schema.MessageInputImage{MessagePartCommon: schema.MessagePartCommon{URL: ptr("https://example.test/a.png")}, Detail: schema.ImageURLDetailLow}},
				{Type: schema.ChatMessagePartTypeImageURL, Image: &schema.MessageInputImage{MessagePartCommon: schema.MessagePartCommon{Base64Data: ptr("AAAA"), MIMEType: "image/png"}}},
			}},
			want: `{"role":"user","content":[
				{"type":"text","text":"What is this?"},
				{"type":"image_url","image_url":{"url":"https://example.test/a.png","detail":"low"}},
				{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}`,
		},
		{
			name: "assistant output parts",
			in:   &schema.Message{Role: schema.Assistant, AssistantGenMultiContent: []schema.MessageOutputPart{{Type: schema.ChatMessagePartTypeText, Text: "4"}, {Type: schema.ChatMessagePartTypeText, Text: "2"}}},
			want: `{"role":"assistant","content":[{"type":"text","text":"4"},{"type":"text","text":"2"}]}`,
		},
		{
			name: "legacy parts",
			in: &schema.Message{Role: schema.User, MultiContent: []schema.ChatMessagePart{
				{Type: schema.ChatMessagePartTypeText, Text: "see"},
				{Type: schema.ChatMessagePartTypeImageURL, ImageURL: &schema.ChatMessageImageURL{URL: "https://example.test/b.png"}},
			}},
			want: `{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"https://example.test/b.png"}}]}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := osmoeino.ChatMessages([]*schema.Message{tc.in})
			if err != nil {
				t.Fatalf("ChatMessages: %v", err)
			}
			// The result must equal the JSON it stands for, value for value.
			want := jsonMessages(t, "["+tc.want+"]")
			if !reflect.DeepEqual(got, want) {
				t.Errorf("ChatMessages:\n got %s\nwant %s", mustJSON(got), mustJSON(want))
			}
		})
	}
}

func TestChatMessagesRefuses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    *schema.Message
		field string
	}{
		{name: "nil", in: nil, field: ""},
		{name: "no role", in: &schema.Message{Content: "x"}, field: "role"},
		{name: "content and parts", in: &schema.Message{Role: schema.User, Content: "x", UserInputMultiContent: []schema.MessageInputPart{{Type: schema.ChatMessagePartTypeText, Text: "y"}}}, field: "content"},
		{name: "two kinds of parts", in: &schema.Message{Role: schema.User,
			UserInputMultiContent: []schema.MessageInputPart{{Type: schema.ChatMessagePartTypeText, Text: "y"}},
			MultiContent:          []schema.ChatMessagePart{{Type: schema.ChatMessagePartTypeText, Text: "z"}}}, field: "content"},
		{name: "audio part", in: &schema.Message{Role: schema.User, UserInputMultiContent: []schema.MessageInputPart{{Type: schema.ChatMessagePartTypeAudioURL}}}, field: "content[0].type"},
		{name: "image without data", in: &schema.Message{Role: schema.User, UserInputMultiContent: []schema.MessageInputPart{{Type: schema.ChatMessagePartTypeImageURL, Image: &schema.MessageInputImage{}}}}, field: "content[0].image.url"},
		{name: "base64 image without mime type", in: &schema.Message{Role: schema.User, UserInputMultiContent: []schema.MessageInputPart{{Type: schema.ChatMessagePartTypeImageURL, Image: &schema.MessageInputImage{MessagePartCommon: schema.MessagePartCommon{Base64Data: ptr("AA")}}}}}, field: "content[0].image.mime_type"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := osmoeino.ChatMessages([]*schema.Message{schema.UserMessage("ok"), tc.in})
			var me *osmoeino.MessageError
			if !errors.As(err, &me) || me.Index != 1 || me.Field != tc.field {
				t.Fatalf("ChatMessages = %v, want a *MessageError for message 1 field %q", err, tc.field)
			}
		})
	}
}

func TestSchemaMessages(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string // OpenAI chat JSON
		want *schema.Message
		// roundTrip says ChatMessages gives the input back unchanged.
		roundTrip bool
	}{
		{name: "user", in: `{"role":"user","content":"hi"}`, want: schema.UserMessage("hi"), roundTrip: true},
		{name: "developer", in: `{"role":"developer","content":"rules"}`, want: &schema.Message{Role: "developer", Content: "rules"}, roundTrip: true},
		{name: "null content", in: `{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}`,
			want:      schema.AssistantMessage("", []schema.ToolCall{{ID: "c1", Type: "function", Function: schema.FunctionCall{Name: "multiply", Arguments: `{"a":6,"b":7}`}}}),
			roundTrip: true},
		{name: "tool call without type", in: `{"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"multiply"}}]}`,
			want: schema.AssistantMessage("", []schema.ToolCall{{ID: "c1", Type: "function", Function: schema.FunctionCall{Name: "multiply"}}})},
		{name: "tool result", in: `{"role":"tool","content":"42","tool_call_id":"c1"}`, want: schema.ToolMessage("42", "c1"), roundTrip: true},
		{name: "name and reasoning", in: `{"role":"assistant","content":"42","name":"calc","reasoning_content":"6*7"}`,
			want: &schema.Message{Role: schema.Assistant, Content: "42", Name: "calc", ReasoningContent: "6*7"}, roundTrip: true},
		{name: "user parts", in: `{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"https://example.test/a.png","detail":"high"}}]}`,
			want: &schema.Message{Role: schema.User, UserInputMultiContent: []schema.MessageInputPart{
				{Type: schema.ChatMessagePartTypeText, Text: "look"},
				{Type: schema.ChatMessagePartTypeImageURL, Image: &schema.MessageInputImage{MessagePartCommon: schema.MessagePartCommon{URL: ptr("https://example.test/a.png")}, Detail: schema.ImageURLDetailHigh}},
			}},
			roundTrip: true},
		{name: "system text parts join", in: `{"role":"system","content":[{"type":"text","text":"be "},{"type":"text","text":"brief"}]}`,
			want: schema.SystemMessage("be brief")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := jsonMessages(t, "["+tc.in+"]")
			got, err := osmoeino.SchemaMessages(in)
			if err != nil {
				t.Fatalf("SchemaMessages: %v", err)
			}
			if len(got) != 1 || !reflect.DeepEqual(got[0], tc.want) {
				t.Fatalf("SchemaMessages:\n got %s\nwant %s", mustJSON(got), mustJSON(tc.want))
			}
			if !tc.roundTrip {
				return
			}
			back, err := osmoeino.ChatMessages(got)
			if err != nil {
				t.Fatalf("ChatMessages: %v", err)
			}
			if !reflect.DeepEqual(back, in) {
				t.Errorf("round trip:\n got %s\nwant %s", mustJSON(back), mustJSON(in))
			}
		})
	}
}

// TestSchemaMessagesGoValues accepts messages built in Go, not decoded.
func TestSchemaMessagesGoValues(t *testing.T) {
	got, err := osmoeino.SchemaMessages([]osmo.Message{{
		"role": "assistant",
		"tool_calls": []map[string]any{
			{"id": "c1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":1,"b":2}`}},
		},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(got[0].ToolCalls) != 1 || got[0].ToolCalls[0].Function.Name != "multiply" {
		t.Fatalf("got %s, want the multiply call", mustJSON(got))
	}
}

func TestSchemaMessagesRefuses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    string
		field string
	}{
		{name: "null", in: `null`, field: ""},
		{name: "no role", in: `{"content":"x"}`, field: "role"},
		{name: "role not a string", in: `{"role":1,"content":"x"}`, field: "role"},
		{name: "unknown role", in: `{"role":"robot","content":"x"}`, field: "role"},
		{name: "content a number", in: `{"role":"user","content":5}`, field: "content"},
		{name: "part not an object", in: `{"role":"user","content":["hi"]}`, field: "content[0]"},
		{name: "part without text", in: `{"role":"user","content":[{"type":"text"}]}`, field: "content[0].text"},
		{name: "unknown part", in: `{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}`, field: "content[0].type"},
		{name: "image in a system message", in: `{"role":"system","content":[{"type":"image_url","image_url":{"url":"u"}}]}`, field: "content[0].type"},
		{name: "image without url", in: `{"role":"user","content":[{"type":"image_url","image_url":{}}]}`, field: "content[0].image_url.url"},
		{name: "name not a string", in: `{"role":"user","content":"x","name":3}`, field: "name"},
		{name: "tool without call id", in: `{"role":"tool","content":"42"}`, field: "tool_call_id"},
		{name: "tool calls not a list", in: `{"role":"assistant","tool_calls":{}}`, field: "tool_calls"},
		{name: "tool calls on a user message", in: `{"role":"user","content":"x","tool_calls":[{"id":"c","function":{"name":"f"}}]}`, field: "tool_calls"},
		{name: "call without id", in: `{"role":"assistant","tool_calls":[{"function":{"name":"f"}}]}`, field: "tool_calls[0].id"},
		{name: "call of another type", in: `{"role":"assistant","tool_calls":[{"id":"c","type":"custom","function":{"name":"f"}}]}`, field: "tool_calls[0].type"},
		{name: "call without function", in: `{"role":"assistant","tool_calls":[{"id":"c"}]}`, field: "tool_calls[0].function"},
		{name: "call without name", in: `{"role":"assistant","tool_calls":[{"id":"c","function":{}}]}`, field: "tool_calls[0].function.name"},
		{name: "arguments an object", in: `{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":{"a":1}}}]}`, field: "tool_calls[0].function.arguments"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := jsonMessages(t, `[{"role":"user","content":"ok"},`+tc.in+`]`)
			_, err := osmoeino.SchemaMessages(in)
			if !errors.Is(err, osmo.ErrInvalidInput) {
				t.Fatalf("SchemaMessages = %v, want an error wrapping osmo.ErrInvalidInput", err)
			}
			var me *osmoeino.MessageError
			if !errors.As(err, &me) || me.Index != 1 || me.Field != tc.field {
				t.Fatalf("SchemaMessages = %v, want a *MessageError for message 1 field %q", err, tc.field)
			}
		})
	}
}
