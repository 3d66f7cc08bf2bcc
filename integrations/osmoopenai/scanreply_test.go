package osmoopenai

import (
	"encoding/json"
	"reflect"
	"testing"
)

// Replies as policies answer, and odd ones: what scanReply reads and what
// it leaves to encoding/json.
var scanReplies = []struct {
	body string
	read bool
}{
	{`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"tool_calls","logprobs":null,"message":{"role":"assistant","content":"calling","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}},{"id":"c2","type":"custom","custom":{"name":"grep","input":"x"}},null,{"id":"c3","function":null,"custom":null}]}},{"index":1,"message":5}],"usage":{"prompt_tokens":3}}`, true},
	{`{"id":"x","choices":[{"message":{"role":"assistant","content":null,"refusal":"no","audio":{"id":"a1","data":"AA"},"function_call":{"name":"f","arguments":"{}"},"tool_calls":null}}]}`, true},
	{`{"choices":[{"message":{"role":"assistant","content":"\u00e9\ud83d\ude00 \\n","audio":null,"function_call":null,"tool_calls":[]}}]}`, true},
	{`{"choices":[null]}`, true},
	{`{"choices":[]}`, true},
	{`{"choices":null,"id":null}`, true},
	{`{"choices":[{"message":null,"finish_reason":null}]}`, true},
	{`{"choices":[{"message":{"audio":{}}}]}`, true},

	{`{"choices":[{"message":{"role":"assistant","content":[{"type":"text","text":"parts"}]}}]}`, false},
	{`{"choices":[{"message":{"role":"assistant","tool_calls":[{"function":{"arguments":{"a":1}}}]}}]}`, false},
	{`{"choices":[{"message":{"Role":"assistant"}}]}`, false},
	{`{"choices":[{"message":{"role":"assistant","role":"user"}}]}`, false},
	{`{"choices":[{"message":{"tool_calls":[5]}}]}`, false},
	{`{"choices":[{"message":{"tool_calls":{}}}]}`, false},
	{`{"choices":[{"message":{"audio":"a"}}]}`, false},
	{`{"choices":[5]}`, false},
	{`{"choices":{}}`, false},
	{`{"id":1}`, false},
	{`{"\u0069d":"x"}`, false},
}

// TestScanReplyIsEncodingJSON: what scanReply reads, it reads to the
// reply encoding/json decodes (the first choice and the id).
func TestScanReplyIsEncodingJSON(t *testing.T) {
	for _, c := range scanReplies {
		if !json.Valid([]byte(c.body)) {
			t.Fatalf("not JSON: %s", c.body)
		}
		var r leanReply
		if got := scanReply([]byte(c.body), &r); got != c.read {
			t.Errorf("scanReply(%s) = %v, want %v", c.body, got, c.read)
		}
		checkScanReply(t, []byte(c.body))
	}
}

func FuzzScanReply(f *testing.F) {
	for _, c := range scanReplies {
		f.Add([]byte(c.body))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if json.Valid(data) {
			checkScanReply(t, data)
		}
	})
}

func checkScanReply(t *testing.T, data []byte) {
	t.Helper()
	var got leanReply
	if !scanReply(data, &got) {
		return
	}
	var want leanReply
	_ = json.Unmarshal(data, &want) // a type error past the first choice is not read
	if len(want.Choices) > 1 {
		want.Choices = want.Choices[:1]
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s:\nscanned       %+v\nencoding/json %+v", data, got, want)
	}
}

// BenchmarkScanReply compares scanReply with the encoding/json decode it
// stands in for, on a reply with two tool calls:
//
//	go test -run '^$' -bench ScanReply -benchmem ./integrations/osmoopenai/
func BenchmarkScanReply(b *testing.B) {
	body := []byte(scanReplies[0].body)
	b.Run("scan", func(b *testing.B) {
		for b.Loop() {
			var r leanReply
			if !json.Valid(body) || !scanReply(body, &r) {
				b.Fatal("not read")
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		for b.Loop() {
			var r leanReply
			_ = json.Unmarshal(body, &r)
		}
	})
}
