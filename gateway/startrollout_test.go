package gateway

import (
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// POST /rollout bodies as trainers send them, and odd ones: what
// decodeStartRollout reads, and what it leaves to protojson.
var startBodies = []struct {
	body string
	read bool
}{
	{`{"rollout_id":"r-1","initial_messages":[{"role":"system","content":"Multiply."},{"role":"user","content":"What is 6 * 7?"}],"chat_completions_url":"http://127.0.0.1:8000/v1","completion_callback_url":"http://127.0.0.1:9000/callbacks/completion","grader_callback_url":"http://127.0.0.1:9000/callbacks/grader","label":"42","metadata":{"row":3,"tags":["a"]},"controller_api_key":"k","agent_timeout_sec":30,"grader_timeout_sec":1.5e1,"extra_fields":{"x":{"y":null}}}`, true},
	{`{"initial_messages":[{"role":"user","content":"hi"}],"chat_completions_url":"u","completion_callback_url":"c","llm_api_key":"sk","label":{"a":[1,true]}}`, true},
	{`{"rolloutId":"r","initialMessages":[],"chatCompletionsUrl":"u","completionCallbackUrl":"c","graderCallbackUrl":"g","controllerApiKey":"","agentTimeoutSec":-0,"graderTimeoutSec":0,"extraFields":{},"llmApiKey":"k"}`, true},
	{` { "rollout_id" : null , "label" : null , "metadata" : null , "initial_messages" : null , "grader_callback_url" : null , "agent_timeout_sec" : null } `, true},
	{`{"label":7,"unknown":{"deep":[1,{"k":"v"}]},"other":null}`, true},
	{`{}`, true},
	{`{"rollout_id":"caf\u00e9\n"}`, true},

	{`{"rollout_id":"a","rolloutId":"b"}`, false},
	{`{"rollout_id":null,"rollout_id":"b"}`, false},
	{`{"agent_timeout_sec":"30"}`, false},
	{`{"agent_timeout_sec":"NaN"}`, false},
	{`{"agent_timeout_sec":1e400}`, false},
	{`{"rollout_id":5}`, false},
	{`{"initial_messages":[null]}`, false},
	{`{"initial_messages":{}}`, false},
	{`{"metadata":[]}`, false},
	{`{"[osmo.ext]":1}`, false},
	{`{"rollout_id":"r"} x`, false},
	{"{\"rollout_id\":\"\xff\"}", false},
	{`{"unknown":{"a":1,"a":2}}`, false},
	{`[]`, false},
	{``, false},
}

// TestStartRolloutBodyIsProtojson: what decodeStartRollout reads, it reads
// to the message protojson decodes with the gateway's options.
func TestStartRolloutBodyIsProtojson(t *testing.T) {
	for _, b := range startBodies {
		var req rolloutv1.StartRolloutRequest
		if got := decodeStartRollout([]byte(b.body), &req); got != b.read {
			t.Errorf("decodeStartRollout(%s) = %v, want %v", b.body, got, b.read)
		}
		checkStartBody(t, []byte(b.body))
	}
}

func FuzzStartRolloutBody(f *testing.F) {
	for _, b := range startBodies {
		f.Add([]byte(b.body))
	}
	f.Fuzz(func(t *testing.T, data []byte) { checkStartBody(t, data) })
}

func checkStartBody(t *testing.T, data []byte) {
	t.Helper()
	var got rolloutv1.StartRolloutRequest
	if !decodeStartRollout(data, &got) {
		return
	}
	var want rolloutv1.StartRolloutRequest
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(data, &want); err != nil {
		t.Fatalf("%q: read, but protojson fails: %v", data, err)
	}
	if !proto.Equal(&got, &want) {
		t.Errorf("%q:\nread      %v\nprotojson %v", data, &got, &want)
	}
}

// BenchmarkStartRolloutBody compares decodeStartRollout with protojson on
// the first body above:
//
//	go test -run '^$' -bench StartRolloutBody -benchmem ./gateway/
func BenchmarkStartRolloutBody(b *testing.B) {
	body := []byte(startBodies[0].body)
	b.Run("read", func(b *testing.B) {
		for b.Loop() {
			var req rolloutv1.StartRolloutRequest
			if !decodeStartRollout(body, &req) {
				b.Fatal("not read")
			}
		}
	})
	b.Run("protojson", func(b *testing.B) {
		for b.Loop() {
			var req rolloutv1.StartRolloutRequest
			if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(body, &req); err != nil {
				b.Fatal(err)
			}
		}
	})
}
