package rollout

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// A sample's calls keep only the request messages after those they share
// with the previous call; every body that shows a call's request has it
// whole, as the proxy recorded it.
func TestRecordedCallsShareHistory(t *testing.T) {
	reqs := []string{
		`[{"role":"system","content":"s"},{"role":"user","content":"2*3?"}]`,
		// Extends the first (with its own spacing between messages).
		"[ {\"role\":\"system\",\"content\":\"s\"} ,\n{\"role\":\"user\",\"content\":\"2*3?\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"t\",\"function\":{\"name\":\"mul\",\"arguments\":\"{\\\"a\\\":[2,3]}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"t\",\"content\":\"6\"}]",
		// Rewrites the second message: shares one.
		`[{"role":"system","content":"s"},{"role":"user","content":"2*3, please"}]`,
		// A failed request recorded without messages.
		``,
		`[{"role":"system","content":"s"}]`,
	}
	rec := &record{}
	for i, r := range reqs {
		rec.addCall(&llmproxy.Call{SampleID: "a", ID: fmt.Sprint("a", i), RequestMessages: json.RawMessage(r), ResponseMessage: json.RawMessage(`{"role":"assistant","content":"ok"}`)})
		// Another sample's calls in between change nothing of a's.
		rec.addCall(&llmproxy.Call{SampleID: "b", ID: fmt.Sprint("b", i), RequestMessages: json.RawMessage(`[{"role":"user","content":"x"}]`)})
	}
	calls := rec.callsOf("a")
	var shared []int
	for _, c := range calls {
		shared = append(shared, c.shared)
		if c.RequestMessages != nil {
			t.Errorf("%s keeps the request body", c.ID)
		}
	}
	if want := []int{0, 2, 1, 0, 0}; !reflect.DeepEqual(shared, want) {
		t.Errorf("shared = %v, want %v", shared, want)
	}
	stored := callProtos(calls, nil)
	if n := stored[1].GetSharedRequestMessages(); n != 2 || len(stored[1].GetRequestMessages()) != 2 {
		t.Errorf("stored second call shares %d and holds %d", n, len(stored[1].GetRequestMessages()))
	}
	ws := newWireSample(&rolloutv1.RolloutSample{Id: "a", LlmCalls: stored}, true)
	api := wholeCalls(stored)
	var prev []any // the callback's previous call, whole, as a trainer rebuilds it
	for i, r := range reqs {
		want := []any{}
		if r != "" {
			_ = json.Unmarshal([]byte(r), &want)
		}
		// The callback carries each call as stored; its whole request is
		// the previous one's first shared_request_messages, then its own.
		wc := ws.LLMCalls[i]
		if int(wc.SharedRequestMessages) != shared[i] {
			t.Errorf("callback call %d: shared_request_messages %d, want %d", i, wc.SharedRequestMessages, shared[i])
		}
		own, _ := generic(t, wc.RequestMessages).([]any)
		got := append(append([]any{}, prev[:min(int(wc.SharedRequestMessages), len(prev))]...), own...)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("callback call %d rebuilt: request_messages %v, want %v", i, got, want)
		}
		prev = got
		if got := generic(t, jsonStructs(api[i].GetRequestMessages())); !reflect.DeepEqual(got, want) || api[i].GetSharedRequestMessages() != 0 {
			t.Errorf("API call %d: request_messages %v (shared %d), want %v", i, got, api[i].GetSharedRequestMessages(), want)
		}
	}
	// The stored calls are not changed by expanding them.
	if !proto.Equal(stored[1], callProtos(calls, nil)[1]) || stored[1].GetSharedRequestMessages() != 2 {
		t.Error("expanding changed the stored calls")
	}
	if got := recordedConversation(calls[:3]); len(got) != 3 || got[1]["content"] != "2*3, please" {
		t.Errorf("recorded conversation = %v", got)
	}
}

func TestSplitArray(t *testing.T) {
	for in, want := range map[string]int{
		`[]`: 0, ` [ {"a":"]}\"{"} , {"b":[{}]} ] `: 2, `[{"a":1},2]`: -1, `{"a":1}`: -1, ``: -1, `["x"]`: -1,
	} {
		got := splitArray([]byte(in))
		if (got == nil && want != -1 && want != 0) || (want == -1 && got != nil) || (want >= 0 && len(got) != want) {
			t.Errorf("splitArray(%q) = %q, want %d elements", in, got, want)
		}
		for _, m := range got {
			if !json.Valid(m) || !strings.HasPrefix(string(m), "{") {
				t.Errorf("splitArray(%q): element %q", in, m)
			}
		}
	}
}

// toStruct's direct conversion gives what the conversion through JSON
// gives, and falls back to it for everything else.
func TestToStructAsThroughJSON(t *testing.T) {
	type point struct{ X, Y int }
	for i, m := range []map[string]any{
		nil, {}, {"role": "user", "content": "hi <b>&</b> \u2028"},
		{"n": 1.5e21, "i": 1 << 60, "i64": int64(-(1 << 62)), "i32": int32(7), "f": 1e-7, "z": 0.0, "b": true, "null": nil},
		{"nested": map[string]any{"list": []any{1.0, "x", nil, []any{}, map[string]any{}}}, "nilmap": map[string]any(nil), "nillist": []any(nil)},
		{"bad": "a\xffb"}, {"bad\xff": 1.0}, {"f32": float32(0.1)}, {"typed": []string{"a", "b"}}, {"s": point{1, 2}},
		{"nan": math.NaN()}, {"inf": map[string]any{"x": math.Inf(1)}}, {"num": json.Number("12.50")},
	} {
		got, gerr := toStruct(m)
		var want structpb.Struct
		b, werr := json.Marshal(m)
		if werr == nil {
			werr = protojson.Unmarshal(b, &want)
		}
		if (gerr != nil) != (werr != nil) {
			t.Errorf("%d: error %v, through JSON %v", i, gerr, werr)
			continue
		}
		if gerr == nil && !proto.Equal(got, &want) {
			t.Errorf("%d: %v, through JSON %v", i, got, &want)
		}
	}
}

// A response's tool calls are counted from its decoded message as
// decoding the raw one counted them.
func TestToolCallsAsDecoded(t *testing.T) {
	for _, raw := range []string{
		``, `{}`, `{"tool_calls":null}`, `{"tool_calls":[]}`, `{"tool_calls":[{"id":"a"},{"id":"b"}]}`,
		`{"tool_calls":"x"}`, `{"tool_calls":{"a":1}}`, `{"Tool_Calls":[1,2,3]}`, `{"tool_calls":[1],"TOOL_CALLS":[1,2]}`,
		`{"tool_calls":[1],"tool_calls":[1,2]}`, `not json`, `[1]`,
	} {
		var want int
		var resp struct {
			ToolCalls []json.RawMessage `json:"tool_calls"`
		}
		if raw != "" && json.Unmarshal([]byte(raw), &resp) == nil {
			want = len(resp.ToolCalls)
		}
		var decoded *structpb.Struct
		if s := (&structpb.Struct{}); raw != "" && protojson.Unmarshal([]byte(raw), s) == nil {
			decoded = s
		}
		if got := toolCalls(json.RawMessage(raw), decoded); got != want {
			t.Errorf("%s: %d tool calls, want %d", raw, got, want)
		}
	}
}

// TestSampleMessagesDecodedOnce: a sample's messages and its calls'
// request messages that are the same JSON are one Struct (decoded once),
// and what is stored is what decoding each afresh stores.
func TestSampleMessagesDecodedOnce(t *testing.T) {
	system, user := `{"role":"system","content":"s"}`, `{"role":"user","content":"2*3?"}`
	asked := `{"role":"assistant","tool_calls":[{"id":"t","type":"function","function":{"name":"mul","arguments":"{}"}}]}`
	tool := `{"role":"tool","tool_call_id":"t","content":"6"}`
	rec := &record{}
	rec.addCall(&llmproxy.Call{SampleID: "a", ID: "a0", RequestMessages: json.RawMessage("[" + system + "," + user + "]"),
		// The policy's answer, its keys in another order than the agent's.
		ResponseMessage: json.RawMessage(`{"tool_calls":[{"id":"t","type":"function","function":{"name":"mul","arguments":"{}"}}],"role":"assistant","content":null}`)})
	rec.addCall(&llmproxy.Call{SampleID: "a", ID: "a1", RequestMessages: json.RawMessage("[" + system + "," + user + "," + asked + "," + tool + "]"),
		ResponseMessage: json.RawMessage(`{"role":"assistant","content":"6"}`)})
	calls := rec.callsOf("a")
	raw := []json.RawMessage{json.RawMessage(system), json.RawMessage(user), json.RawMessage(asked), json.RawMessage(tool), json.RawMessage(`{"role":"assistant","content":"6"}`)}

	var d decoded
	stored := callProtos(calls, &d)
	msgs, err := sourceStructs(raw, &d)
	if err != nil {
		t.Fatal(err)
	}
	same := func(what string, a, b *structpb.Struct, want bool) {
		t.Helper()
		if (a == b) != want {
			t.Errorf("%s: one Struct %v, want %v", what, a == b, want)
		}
	}
	same("system message and call 0's", msgs[0], stored[0].GetRequestMessages()[0], true)
	same("user message and call 0's", msgs[1], stored[0].GetRequestMessages()[1], true)
	same("tool call message and call 1's", msgs[2], stored[1].GetRequestMessages()[0], true)
	same("tool message and call 1's", msgs[3], stored[1].GetRequestMessages()[1], true)
	same("last answer and call 1's response (the same JSON)", msgs[4], stored[1].GetResponseMessage(), true)
	same("tool call message and call 0's response (other JSON)", msgs[2], stored[0].GetResponseMessage(), false)

	fresh := callProtos(calls, nil)
	for i := range stored {
		if !proto.Equal(stored[i], fresh[i]) {
			t.Errorf("call %d decoded once differs from decoded afresh:\n%v\n%v", i, stored[i], fresh[i])
		}
	}
	freshMsgs, _ := sourceStructs(raw, nil)
	for i := range msgs {
		if !proto.Equal(msgs[i], freshMsgs[i]) {
			t.Errorf("message %d decoded once differs from decoded afresh", i)
		}
	}
}
