package llmproxy

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/internal/jsonscan"
)

// Bodies as policies answer, and the odd ones a policy may send: what
// readCompletion reads, and what it leaves to encoding/json.
var completionBodies = []struct {
	body string
	read bool // by readCompletion
}{
	{`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"4","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":2,\"b\":2}"}}]},"logprobs":{"content":[{"token":"4","logprob":-0.25,"bytes":[52],"top_logprobs":[{"token":"4","logprob":-0.25}]},{"token":"","logprob":-1e-3}]},"finish_reason":"tool_calls","token_ids":[19,2]}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}},"prompt_token_ids":[1,2,3]}`, true},
	{`{"id":"x","choices":[{"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":null}}`, true},
	{` { "id" : "sp" , "choices" : [ { "message" : null , "finish_reason" : null , "token_ids" : [ ] } , 5 ] , "usage" : null } `, true},
	{`{"choices":[],"prompt_token_ids":null}`, true},
	{`{"choices":null,"id":null}`, true},
	{`{"choices":[null]}`, true},
	{`{"choices":[{"logprobs":{"content":[null,{"logprob":null},{}]}}]}`, true},
	{`{"choices":[{"logprobs":{"content":[]}}]}`, true},
	{`{"choices":[{"logprobs":null,"token_ids":null}]}`, true},
	{`{"id":"caf\u00e9","choices":[{"finish_reason":"st\"op"}]}`, true},
	{"{\"id\":\"\xff\"}", true},
	{`{"choices":[{"token_ids":[-2147483648,2147483647]}]}`, true},
	{`{"choices":[{"logprobs":{"content":[{"logprob":-0},{"logprob":1E2}]}}]}`, true},
	{`{"usage":{"prompt_tokens":-1,"total_tokens":9223372036854775807}}`, true},
	{`{"other":{"id":5,"choices":"x"},"list":[{"usage":1}]}`, true},

	{`{"ID":"x"}`, false},
	{`{"Choices":[]}`, false},
	{`{"choices":[{"Message":{}}]}`, false},
	{`{"choices":[{"message":{},"message":{}}]}`, false},
	{`{"id":"a","id":"b"}`, false},
	{`{"\u0069d":"x"}`, false},
	{"{\"\u212Aey\":1,\"toKen_ids\":[]}", true},
	{`{"choices":[{"token_ids":[2147483648]}]}`, false},
	{`{"choices":[{"token_ids":[1.0]}]}`, false},
	{`{"choices":[{"token_ids":[1,null]}]}`, false},
	{`{"choices":[{"token_ids":"1"}]}`, false},
	{`{"choices":[{"logprobs":{"content":[{"logprob":"-1"}]}}]}`, false},
	{`{"choices":[{"logprobs":{"content":[{"logprob":1e400}]}}]}`, false},
	{`{"choices":[{"logprobs":{"content":[5]}}]}`, false},
	{`{"choices":[{"logprobs":{"content":{}}}]}`, false},
	{`{"choices":[{"finish_reason":5}]}`, false},
	{`{"choices":{}}`, false},
	{`{"choices":[5]}`, false},
	{`{"usage":{"prompt_tokens":1.5}}`, false},
	{`{"usage":{"prompt_tokens":1e2}}`, false},
	{`{"usage":{"prompt_tokens":9223372036854775808}}`, false},
	{`{"usage":{"prompt_tokens_details":{"cached_tokens":"1"}}}`, false},
	{`{"usage":[]}`, false},
	{`{"id":true}`, false},
	{`{"prompt_token_ids":{}}`, false},
}

// TestReadCompletionIsEncodingJSON: what readCompletion reads, it reads to
// the record encoding/json makes; what it does not, it leaves as it found.
func TestReadCompletionIsEncodingJSON(t *testing.T) {
	for _, b := range completionBodies {
		if !json.Valid([]byte(b.body)) {
			t.Fatalf("not JSON: %s", b.body)
		}
		var c Call
		if read := readCompletion(&c, []byte(b.body)); read != b.read {
			t.Errorf("readCompletion(%s) = %v, want %v", b.body, read, b.read)
		}
		checkSameRecord(t, []byte(b.body))
	}
	// The first body, whole.
	var c Call
	readCompletion(&c, []byte(completionBodies[0].body))
	want := Call{
		ID: "chatcmpl-1", FinishReason: "tool_calls",
		ResponseMessage:    json.RawMessage(`{"role":"assistant","content":"4","tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":2,\"b\":2}"}}]}`),
		Usage:              Usage{PromptTokens: 12, CompletionTokens: 2, TotalTokens: 14, CachedTokens: 8},
		PromptTokenIDs:     []int32{1, 2, 3},
		CompletionTokenIDs: []int32{19, 2},
		Logprobs:           []float64{-0.25, -1e-3},
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("read\n%+v\nwant\n%+v", c, want)
	}
}

// The message is the body's bytes, copied: the body's buffer is reused.
func TestReadCompletionCopiesTheMessage(t *testing.T) {
	body := []byte(`{"choices":[{"message":{"content":"a"}}]}`)
	var c Call
	if !readCompletion(&c, body) {
		t.Fatal("not read")
	}
	copy(body, strings.Repeat("x", len(body)))
	if string(c.ResponseMessage) != `{"content":"a"}` {
		t.Errorf("message = %s after the body changed", c.ResponseMessage)
	}
}

func FuzzRecordCompletion(f *testing.F) {
	for _, b := range completionBodies {
		f.Add([]byte(b.body))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		i := jsonscan.SkipSpace(data, 0)
		if i >= len(data) || data[i] != '{' || !json.Valid(data) {
			return
		}
		checkSameRecord(t, data)
	})
}

// checkSameRecord: a body readCompletion reads is recorded as
// decodeCompletion records it; one it does not read leaves the call as it
// was.
func checkSameRecord(t *testing.T, data []byte) {
	t.Helper()
	before := Call{ID: "before", Usage: Usage{PromptTokens: 7}}
	fast, slow := before, before
	if !readCompletion(&fast, data) {
		if !reflect.DeepEqual(fast, before) {
			t.Errorf("%s: not read, yet the call changed: %+v", data, fast)
		}
		return
	}
	decodeCompletion(&slow, data)
	if !reflect.DeepEqual(fast, slow) {
		t.Errorf("%s:\nread      %+v\nencoding/json %+v", data, fast, slow)
	}
}

// BenchmarkRecordCompletion compares readCompletion with the encoding/json
// reading it stands in for, on a policy's answer with a tool call, token
// ids and logprobs:
//
//	go test -run '^$' -bench RecordCompletion -benchmem ./pkg/llmproxy/
func BenchmarkRecordCompletion(b *testing.B) {
	body := []byte(completionBodies[0].body)
	b.Run("read", func(b *testing.B) {
		for b.Loop() {
			var c Call
			if err := recordCompletion(&c, body); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		for b.Loop() {
			var c Call
			if !json.Valid(body) {
				b.Fatal("not JSON")
			}
			decodeCompletion(&c, body)
		}
	})
}
