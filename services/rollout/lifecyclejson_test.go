package rollout

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"
	"time"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// TestLifecycleMarshal holds lifecycle.appendJSON to what json.Marshal writes
// for the struct: the same JSON value (keys, omitted fields, nulls), which
// decodes to the same lifecycle.
func TestLifecycleMarshal(t *testing.T) {
	reward := 0.25
	tiny := 1e-9
	created := time.Date(2026, 11, 27, 3, 4, 5, 123456789, time.UTC)
	full := &lifecycle{
		ID: "r-1", Key: "key \"quoted\" <b>&", Wire: "g2", Workflow: "multiply",
		Created:  created,
		Request:  []byte{0, 1, 2, 0xff, 'x'},
		Response: []byte("init"),
		Trace:    map[string]string{"traceparent": "00-abc-def-01", "baggage": "a=b", "tracestate": ""},
		Phase:    phaseFinal, State: rolloutv1.State_STATE_GRADING,
		Owner: "replica-2", Held: "42", Started: created.Add(time.Second), Cancelled: true,
		Ran: &owedStage{
			Outcome: savedOutcome{State: rolloutv1.State_STATE_SUCCEEDED},
			Callbacks: []savedCallback{
				{Event: "rollout_completed", Route: "/completed", URL: "http://127.0.0.1:1/cb?a=1&b=2", Bearer: "sealed\u2028", Status: "succeeded", Payload: json.RawMessage(`{"a":[1,2.5,"x\n"],"b":{"c":null}}`)},
				{Event: "e2", Route: "r", URL: "u", Status: "s"},
			},
			Done:    []bool{true, false},
			Sending: true,
		},
		Final: &owedStage{
			Outcome: savedOutcome{State: rolloutv1.State_STATE_FAILED, Category: outcome.Timeout, Message: "tab\there, ünïcode, \x01"},
		},
		Outcome:       &savedOutcome{State: rolloutv1.State_STATE_FAILED, Category: outcome.Agent},
		Reward:        &reward,
		Finished:      created.Add(time.Minute),
		CallbackError: "refused: 400",
	}
	small := *full
	small.Reward = &tiny
	cases := map[string]*lifecycle{
		"empty": {},
		"queued": {ID: "r-2", Key: "r-2", Wire: "v03", Workflow: "w", Created: time.Now(), Request: []byte("req"), Phase: phaseQueued,
			State: rolloutv1.State_STATE_QUEUED},
		"full":         full,
		"small reward": &small,
		"empty stage":  {ID: "r-3", Ran: &owedStage{Callbacks: []savedCallback{}, Done: []bool{}}},
	}
	for name, lc := range cases {
		t.Run(name, func(t *testing.T) {
			got := lc.appendJSON(nil, true)
			if reused := lc.appendJSON([]byte(`{"id":"an earlier lifecycle, longer than some"}`), true); !bytes.Equal(reused, got) {
				t.Errorf("appendJSON into a used buffer:\n%s\nwant\n%s", reused, got)
			}
			sameAsMarshal(t, got, lc)
			// Not inline: as the lifecycle without its request and payloads.
			bare := lc.clone()
			bare.Request = nil
			for _, st := range []*owedStage{bare.Ran, bare.Final} {
				if st != nil {
					for i := range st.Callbacks {
						st.Callbacks[i].Payload = nil
					}
				}
			}
			sameAsMarshal(t, lc.appendJSON(nil, false), bare)
		})
	}
}

// sameAsMarshal fails unless got is the JSON value json.Marshal writes for
// lc, and decodes to what that does.
func sameAsMarshal(t *testing.T, got []byte, lc *lifecycle) {
	t.Helper()
	want, err := json.Marshal(lc)
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(got) {
		t.Fatalf("not JSON: %s", got)
	}
	var gotV, wantV any
	if err := json.Unmarshal(got, &gotV); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(want, &wantV); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(gotV, wantV) {
		t.Fatalf("appendJSON:\n%s\njson.Marshal:\n%s", got, want)
	}
	var back, wantBack lifecycle
	if err := json.Unmarshal(got, &back); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(want, &wantBack); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, wantBack) {
		t.Fatalf("decoded:\n%+v\nwant:\n%+v", back, wantBack)
	}
}

// BenchmarkLifecycleMarshal compares lifecycle.appendJSON, into a new
// buffer and into a reused one, with json.Marshal on a lifecycle owing both
// stages, a G2 callback payload in each.
func BenchmarkLifecycleMarshal(b *testing.B) {
	payload, _ := json.Marshal(map[string]any{
		"rollout_id": "r-1", "status": "COMPLETED",
		"samples": []any{map[string]any{"id": "s", "messages": []any{
			map[string]any{"role": "system", "content": "Use the multiply tool when arithmetic is required."},
			map[string]any{"role": "user", "content": "What is 6 times 7?"},
			map[string]any{"role": "assistant", "content": "", "tool_calls": []any{map[string]any{"id": "call_1", "type": "function", "function": map[string]any{"name": "multiply", "arguments": `{"a":6,"b":7}`}}}},
			map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "42"},
			map[string]any{"role": "assistant", "content": "6 times 7 is 42."},
		}}},
	})
	stage := func() *owedStage {
		return &owedStage{Outcome: savedOutcome{State: rolloutv1.State_STATE_SUCCEEDED}, Callbacks: []savedCallback{
			{Event: "completed", Route: "/v1/rollout/completed", URL: "http://127.0.0.1:9000/v1/rollout/completed", Bearer: "sealed-bearer", Status: "succeeded", Payload: payload},
		}, Done: []bool{false}}
	}
	lc := &lifecycle{ID: "r-1", Key: "r-1", Wire: "g2", Workflow: "multiply", Created: time.Now(), Request: make([]byte, 600),
		Trace: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		Phase: phaseFinal, State: rolloutv1.State_STATE_SUCCEEDED, Owner: "replica", Held: "12", Started: time.Now(),
		Ran: stage(), Final: stage()}
	b.Run("appendJSON, new buffer", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = lc.appendJSON(nil, true)
		}
	})
	// As the state writes use it: into a buffer kept between writes.
	b.Run("appendJSON, reused buffer", func(b *testing.B) {
		b.ReportAllocs()
		var buf []byte
		for b.Loop() {
			buf = lc.appendJSON(buf, true)
		}
	})
	b.Run("json.Marshal", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = json.Marshal(lc)
		}
	})
}
