package osmo

import "testing"

func TestParseChatCompletion(t *testing.T) {
	res, err := parseChatCompletion([]byte(`{"id":"c","choices":[{"message":{"role":"assistant","content":null,
		"tool_calls":[{"id":"t1","type":"function","function":{"name":"add","arguments":"{\"a\":1}"}}]},"finish_reason":"tool_calls"}],
		"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}`))
	if err != nil {
		t.Fatal(err)
	}
	if !res.HasToolCalls() || res.ToolCalls[0].Function.Name != "add" || res.Usage.TotalTokens != 7 || res.FinishReason != "tool_calls" {
		t.Fatalf("%+v", res)
	}
	for _, bad := range []string{`{`, `{"choices":[]}`, `{"choices":[{}]}`, `{"choices":[{"message":{"tool_calls":"x"}}]}`} {
		if _, err := parseChatCompletion([]byte(bad)); err == nil {
			t.Errorf("parseChatCompletion(%s) accepted garbage", bad)
		}
	}
}
