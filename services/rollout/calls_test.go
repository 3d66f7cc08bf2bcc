package rollout

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/osmo-rl/osmo"
)

// messages is the JSON of each of texts as a user message.
func messages(texts ...string) []json.RawMessage {
	out := make([]json.RawMessage, len(texts))
	for i, t := range texts {
		out[i] = json.RawMessage(fmt.Sprintf(`{"role":"user","content":%q}`, t))
	}
	return out
}

// TestRecordedCallsShareHistory: a sample's calls keep only the request
// messages after those they share with the call before, each sample
// counted on its own, and expand back to the requests as sent.
func TestRecordedCallsShareHistory(t *testing.T) {
	rec := &record{}
	sent := [][]json.RawMessage{
		messages("a"),
		messages("a", "b"),
		messages("a", "b", "c"),
		messages("x", "b"), // rewritten history: shares nothing
		messages("x"),
	}
	for i, msgs := range sent {
		rec.addCall(&osmo.LLMCall{SampleID: "s", ID: fmt.Sprint(i), RequestMessages: msgs})
		rec.addCall(&osmo.LLMCall{SampleID: "other", ID: fmt.Sprint(i), RequestMessages: messages("o")})
	}
	calls := rec.callsOf("s")
	wantShared := []int{0, 1, 2, 0, 1}
	wantOwn := []int{1, 1, 1, 2, 0}
	for i, c := range calls {
		if c.SharedRequestMessages != wantShared[i] || len(c.RequestMessages) != wantOwn[i] {
			t.Errorf("call %d: shared %d, own %d; want %d, %d", i, c.SharedRequestMessages, len(c.RequestMessages), wantShared[i], wantOwn[i])
		}
	}
	for i, whole := range wholeRequests(calls) {
		got, _ := json.Marshal(whole)
		want, _ := json.Marshal(sent[i])
		if string(got) != string(want) {
			t.Errorf("call %d expands to %s, want %s", i, got, want)
		}
	}
	for i, c := range rec.callsOf("other") {
		if c.SharedRequestMessages != min(i, 1) || len(c.RequestMessages) != 1-min(i, 1) {
			t.Errorf("other sample's call %d: shared %d, own %d", i, c.SharedRequestMessages, len(c.RequestMessages))
		}
	}
}

// TestRecordedConversation: a sample whose source gives no messages is the
// last successful call's request and its answer.
func TestRecordedConversation(t *testing.T) {
	answer := json.RawMessage(`{"role":"assistant","content":"6"}`)
	rec := &record{}
	rec.addCall(&osmo.LLMCall{SampleID: "s", RequestMessages: messages("2*3?"), ResponseMessage: answer})
	rec.addCall(&osmo.LLMCall{SampleID: "s", RequestMessages: messages("2*3?", "again"), Error: "upstream answered 500"})
	got, _ := json.Marshal(recordedConversation(rec.callsOf("s")))
	if want := `[{"role":"user","content":"2*3?"},{"role":"assistant","content":"6"}]`; string(got) != want {
		t.Errorf("recorded conversation %s, want %s", got, want)
	}
}
