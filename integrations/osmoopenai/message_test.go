package osmoopenai_test

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
)

func TestMessageParamRoundTrips(t *testing.T) {
	tests := []osmo.Message{
		{"role": "system", "content": "be brief"},
		{"role": "developer", "content": "be brief"},
		{"role": "user", "content": "hi <b>&amp;</b> \u2028 \x01"},
		{"role": "assistant", "content": "42"},
		{"role": "assistant", "content": ""},
		{"role": "user", "content": "hi", "name": "ann"},
		{"role": "user", "content": []any{map[string]any{"type": "text", "text": "hi"}}},
		{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
			"id": "c1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":6,"b":7}`},
		}}},
		{"role": "tool", "content": "42", "tool_call_id": "c1"},
	}
	for _, m := range tests {
		t.Run(m["role"].(string), func(t *testing.T) {
			p, err := osmoopenai.MessageParam(m)
			if err != nil {
				t.Fatal(err)
			}
			if role := p.GetRole(); role == nil || *role != m["role"] {
				t.Errorf("param role = %v, want %v", role, m["role"])
			}
			b, err := json.Marshal(p)
			if err != nil {
				t.Fatal(err)
			}
			var got osmo.Message
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			want := osmo.CloneMessages([]osmo.Message{m})[0]
			if want["content"] == nil {
				delete(want, "content")
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("param encodes to %v, want %v", got, want)
			}
		})
	}
}

func TestMessageParamsErrors(t *testing.T) {
	valid := osmo.Message{"role": "user", "content": "ok"}
	tests := []struct {
		name  string
		msg   osmo.Message
		field string
	}{
		{"null message", nil, ""},
		{"no role", osmo.Message{"content": "x"}, "role"},
		{"role not a string", osmo.Message{"role": 1, "content": "x"}, "role"},
		{"unknown role", osmo.Message{"role": "narrator", "content": "x"}, "role"},
		{"unknown field", osmo.Message{"role": "system", "content": "x", "weight": 2}, "weight"},
		{"content of the wrong type", osmo.Message{"role": "user", "content": 5}, "content"},
		{"unknown field in a part", osmo.Message{"role": "user", "content": []any{map[string]any{"type": "text", "text": "x", "bold": true}}}, "content[0].bold"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := osmoopenai.MessageParams([]osmo.Message{valid, tc.msg})
			var me *osmoopenai.MessageError
			if !errors.As(err, &me) {
				t.Fatalf("err = %v, want a *MessageError", err)
			}
			if me.Index != 1 || me.Field != tc.field {
				t.Errorf("error names message %d field %q, want message 1 field %q (%v)", me.Index, me.Field, tc.field, err)
			}
		})
	}
}

func TestMessageParamsEmpty(t *testing.T) {
	got, err := osmoopenai.MessageParams(nil)
	if err != nil || len(got) != 0 {
		t.Fatalf("MessageParams(nil) = %v, %v; want none", got, err)
	}
}
