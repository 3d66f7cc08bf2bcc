package rollout

import (
	"encoding/json"
	"testing"
)

// TestHeldPayloads: what a lifecycle read back without its payloads gets
// back from heldPayloads: the payloads of its callbacks not done, by stage
// and index; nothing once it is finished, and nothing for another rollout.
func TestHeldPayloads(t *testing.T) {
	stage := func(payloads ...string) *owedStage {
		st := &owedStage{Callbacks: make([]savedCallback, len(payloads)), Done: make([]bool, len(payloads))}
		for i, p := range payloads {
			st.Callbacks[i] = savedCallback{Event: "e", Payload: json.RawMessage(p)}
		}
		return st
	}
	bare := func(lc *lifecycle) *lifecycle {
		var back lifecycle
		if err := json.Unmarshal(lc.appendJSON(nil, false), &back); err != nil {
			t.Fatal(err)
		}
		return &back
	}
	payload := func(st *owedStage, i int) string { return string(st.Callbacks[i].Payload) }

	var h heldPayloads
	lc := &lifecycle{ID: "r", Phase: phaseRan, Ran: stage(`{"ran":0}`, `{"ran":1}`)}
	h.keep(lc)
	// The final stage is owed with the first stage's first callback done.
	lc.Ran.Done[0], lc.Ran.Callbacks[0].Payload = true, nil
	lc.Phase, lc.Final = phaseFinal, stage(`{"final":0}`)
	h.keep(lc)

	back := bare(lc)
	if back.Ran.Callbacks[1].Payload != nil || back.Final.Callbacks[0].Payload != nil {
		t.Fatal("payloads stored without them")
	}
	h.fill(back)
	if got := payload(back.Ran, 0); got != "" {
		t.Errorf("a done callback got its payload back: %s", got)
	}
	if got := payload(back.Ran, 1); got != `{"ran":1}` {
		t.Errorf("ran[1]: %q", got)
	}
	if got := payload(back.Final, 0); got != `{"final":0}` {
		t.Errorf("final[0]: %q", got)
	}

	other := bare(&lifecycle{ID: "other", Phase: phaseRan, Ran: stage(`{}`)})
	h.fill(other)
	if got := payload(other.Ran, 0); got != "" {
		t.Errorf("another rollout's lifecycle got %q", got)
	}

	finished := bare(&lifecycle{ID: "r", Phase: phaseFinished})
	h.fill(finished)
	if h.len() != 0 {
		t.Errorf("%d rollouts' payloads held once the lifecycle read is finished", h.len())
	}

	var none *heldPayloads // a state that stores its payloads
	none.keep(lc)
	none.fill(back)
	none.forget("r")
	if none.len() != 0 {
		t.Error("a nil heldPayloads holds something")
	}
}
