package rollout

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/natsstore"
)

// TestHeldParts: what a lifecycle read back without its request and
// payloads gets back from localBodies: its request until its final stage is
// owed, the payloads of its callbacks not done, by stage and index;
// nothing once it is finished, and nothing for another rollout. A create
// keeps nothing over what another admission of the id holds.
func TestHeldParts(t *testing.T) {
	stage := func(payloads ...string) *owedStage {
		st := &owedStage{Callbacks: make([]savedCallback, len(payloads)), Done: make([]bool, len(payloads))}
		for i, p := range payloads {
			st.Callbacks[i] = savedCallback{Event: "e", Payload: json.RawMessage(p)}
		}
		return st
	}
	bare := func(lc *lifecycle) *lifecycle {
		var back lifecycle
		if err := json.Unmarshal(mustEncode(t, lc, false), &back); err != nil {
			t.Fatal(err)
		}
		return &back
	}
	payload := func(st *owedStage, i int) string { return string(st.Callbacks[i].Payload) }

	var h localBodies
	request := []byte("sealed request")
	created := &lifecycle{ID: "r", Phase: phaseQueued, Request: request}
	if !h.keepNew(created) {
		t.Fatal("a new id's parts not kept")
	}
	if h.keepNew(&lifecycle{ID: "r", Phase: phaseQueued, Request: []byte("another admission's")}) {
		t.Fatal("a create kept parts over those its id holds")
	}
	queued := bare(created)
	if queued.Request != nil {
		t.Fatal("request stored")
	}
	h.fill(queued)
	if string(queued.Request) != string(request) {
		t.Fatalf("request read back %q, want %q", queued.Request, request)
	}

	lc := &lifecycle{ID: "r", Phase: phaseRan, Request: request, Ran: stage(`{"ran":0}`, `{"ran":1}`)}
	h.keep(lc)
	ran := bare(lc)
	h.fill(ran)
	if string(ran.Request) != string(request) || payload(ran.Ran, 0) != `{"ran":0}` {
		t.Fatalf("ran: request %q, first payload %q", ran.Request, payload(ran.Ran, 0))
	}
	// The final stage is owed with the first stage's first callback done.
	lc.Ran.Done[0], lc.Ran.Callbacks[0].Payload = true, nil
	lc.Phase, lc.Final, lc.Request = phaseFinal, stage(`{"final":0}`), nil
	h.keep(lc)

	back := bare(lc)
	if back.Ran.Callbacks[1].Payload != nil || back.Final.Callbacks[0].Payload != nil {
		t.Fatal("payloads stored without them")
	}
	h.fill(back)
	if back.Request != nil {
		t.Errorf("the request read back past the final stage: %q", back.Request)
	}
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

	var none *localBodies // a state that stores its payloads
	none.keep(lc)
	none.fill(back)
	none.forget(lc)
	none.drop("r")
	if none.len() != 0 {
		t.Error("a nil localBodies holds something")
	}
}

// TestHeldPartsOfAnotherAdmission: an id admitted again holds the new
// admission's parts only. A read of the earlier admission's lifecycle (its
// finished one, read as its TTL ends and the id is admitted again) neither
// lets them go nor gets them, and the new admission's writes replace what
// the earlier one left held.
func TestHeldPartsOfAnotherAdmission(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 1, time.UTC)
	t1 := t0.Add(time.Hour)
	var h localBodies

	// The earlier admission left a payload held (a failed create, an init
	// cleared as stale).
	h.keep(&lifecycle{ID: "r", Created: t0, Phase: phaseRan, Request: []byte("old"),
		Ran: &owedStage{Callbacks: []savedCallback{{Payload: json.RawMessage(`{"old":0}`)}, {Payload: json.RawMessage(`{"old":1}`)}}, Done: []bool{false, false}}})

	// The new admission is stored whole (the id holds parts), then its
	// next write keeps its own.
	fresh := &lifecycle{ID: "r", Created: t1, Phase: phaseQueued, Request: []byte("new")}
	if h.keepNew(fresh) {
		t.Fatal("a create kept parts over those its id holds")
	}
	ran := &lifecycle{ID: "r", Created: t1, Phase: phaseRan, Request: []byte("new"),
		Ran: &owedStage{Callbacks: []savedCallback{{Payload: json.RawMessage(`{"new":0}`)}, {}}, Done: []bool{false, false}}}
	h.keep(ran)
	back := &lifecycle{ID: "r", Created: t1, Phase: phaseRan,
		Ran: &owedStage{Callbacks: []savedCallback{{}, {}}, Done: []bool{false, false}}}
	h.fill(back)
	if string(back.Request) != "new" || string(back.Ran.Callbacks[0].Payload) != `{"new":0}` {
		t.Fatalf("read back request %q, ran[0] %s", back.Request, back.Ran.Callbacks[0].Payload)
	}
	if got := back.Ran.Callbacks[1].Payload; got != nil {
		t.Errorf("ran[1] got the earlier admission's payload %s", got)
	}

	// The earlier admission's lifecycle, read: not filled, nothing let go.
	old := &lifecycle{ID: "r", Created: t0, Phase: phaseRan, Ran: &owedStage{Callbacks: []savedCallback{{}}, Done: []bool{false}}}
	h.fill(old)
	if old.Request != nil || old.Ran.Callbacks[0].Payload != nil {
		t.Errorf("the earlier admission's lifecycle got the new one's parts: %q, %s", old.Request, old.Ran.Callbacks[0].Payload)
	}
	h.fill(&lifecycle{ID: "r", Created: t0, Phase: phaseFinished})
	h.forget(&lifecycle{ID: "r", Created: t0, Phase: phaseFinished})
	again := &lifecycle{ID: "r", Created: t1, Phase: phaseRunning}
	h.fill(again)
	if string(again.Request) != "new" {
		t.Fatalf("after the earlier admission's finished lifecycle was read, the request reads back %q", again.Request)
	}

	// Created read back from JSON (another location, no monotonic
	// reading) is the same admission.
	var decoded lifecycle
	if err := json.Unmarshal(mustEncode(t, fresh, false), &decoded); err != nil {
		t.Fatal(err)
	}
	decoded.Created = decoded.Created.In(time.FixedZone("east", 3600))
	h.fill(&decoded)
	if string(decoded.Request) != "new" {
		t.Errorf("a lifecycle read back from JSON got request %q", decoded.Request)
	}
	decoded.Phase = phaseFinished
	h.fill(&decoded)
	if h.len() != 0 {
		t.Errorf("%d held once the new admission finished", h.len())
	}
}

// TestPrivateStateHoldsTheRequest: a private state (an embedded server in
// memory) stores a lifecycle without its request, which a read gives
// back all the same, the request being held in process.
func TestPrivateStateHoldsTheRequest(t *testing.T) {
	s := newCalculatorService(t)
	if !s.sh.store.Private() || s.sh.bodies == nil {
		t.Fatal("the default state is not private, or holds nothing in process")
	}
	ctx := t.Context()
	lc := &lifecycle{ID: "held-1", Key: "held-1", Wire: wireV03, Created: time.Now(), Phase: phaseQueued, Request: []byte("sealed request")}
	if _, _, err := s.sh.create(ctx, lc); err != nil {
		t.Fatal(err)
	}
	e, err := s.sh.rollouts.Get(ctx, natsstore.Key(lc.ID))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(e.Value(), []byte(`"request"`)) {
		t.Errorf("stored with its request: %s", e.Value())
	}
	s.sh.known.drop(lc.ID) // read from the state, not from what this replica wrote
	got, _, err := s.sh.get(ctx, lc.ID)
	if err != nil {
		t.Fatal(err)
	}
	if string(got.Request) != "sealed request" {
		t.Errorf("read back with request %q", got.Request)
	}
	// Another admission of the id finds it taken, and holds nothing.
	if existing, _, err := s.sh.create(ctx, &lifecycle{ID: lc.ID, Key: "other", Created: time.Now(), Phase: phaseQueued, Request: []byte("other")}); err != nil || existing == nil || string(existing.Request) != "sealed request" {
		t.Errorf("a second create: existing %+v, %v", existing, err)
	}
}

// TestDuplicateCreatesKeepTheWinnersRequest: two admissions of one id
// racing (a trainer's duplicate init) in a private state. Whichever
// creates the lifecycle, it is read back with its own request: when the
// other held the id's parts first, the winner's lifecycle is stored whole,
// and the loser's failed create lets go of nothing the winner needs.
func TestDuplicateCreatesKeepTheWinnersRequest(t *testing.T) {
	s := newCalculatorService(t)
	ctx := t.Context()
	const ids = 200
	for i := range ids {
		id := fmt.Sprintf("dup-%d", i)
		var wg sync.WaitGroup
		won := make([]string, 2)
		for j := range 2 {
			wg.Go(func() {
				request := fmt.Sprintf("request %d of %s", j, id)
				lc := &lifecycle{ID: id, Key: id, Wire: wireV03, Created: time.Now(), Phase: phaseQueued, Request: []byte(request)}
				existing, _, err := s.sh.create(ctx, lc)
				if err != nil {
					t.Errorf("%s: create %d: %v", id, j, err)
					return
				}
				if existing == nil {
					won[j] = request
				}
			})
		}
		wg.Wait()
		winner := won[0] + won[1]
		if won[0] != "" && won[1] != "" || winner == "" {
			t.Fatalf("%s: creates won %q", id, won)
		}
		s.sh.known.drop(id) // read from the state, not from what was written
		got, _, err := s.sh.get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if string(got.Request) != winner {
			t.Errorf("%s: read back with request %q, want the winner's %q", id, got.Request, winner)
		}
	}
}

// TestStatusDuringAdmissionKeepsTheRequest: a read of an id whose
// admission has kept its parts but not yet stored its lifecycle (a trainer
// asking for the status of a rollout it is starting) finds nothing, and
// lets go of nothing: the lifecycle stored next is read back with its
// request.
func TestStatusDuringAdmissionKeepsTheRequest(t *testing.T) {
	s := newCalculatorService(t)
	ctx := t.Context()
	for i := range 200 {
		id := fmt.Sprintf("asked-%d", i)
		request := "request of " + id
		var wg sync.WaitGroup
		stop := make(chan struct{})
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, _, err := s.sh.get(ctx, id); err == nil {
					return
				}
			}
		})
		lc := &lifecycle{ID: id, Key: id, Wire: wireV03, Created: time.Now(), Phase: phaseQueued, Request: []byte(request)}
		_, _, err := s.sh.create(ctx, lc)
		close(stop)
		wg.Wait()
		if err != nil {
			t.Fatal(err)
		}
		s.sh.known.drop(id)
		got, _, err := s.sh.get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if string(got.Request) != request {
			t.Errorf("%s: read back with request %q, want %q", id, got.Request, request)
		}
	}
}

// TestDuplicateOfAFinishedRolloutHoldsNothing: a start of an id whose
// lifecycle is finished (a trainer's late duplicate) keeps its parts
// before its create, finds the finished lifecycle, and lets them go: a
// private state holds nothing for it afterwards, and the finished
// lifecycle reads back as it was.
func TestDuplicateOfAFinishedRolloutHoldsNothing(t *testing.T) {
	s := newCalculatorService(t)
	ctx := t.Context()
	const id = "finished-dup"
	first := &lifecycle{ID: id, Key: id, Wire: wireV03, Created: time.Now(), Phase: phaseQueued, Request: []byte("first")}
	if _, _, err := s.sh.create(ctx, first); err != nil {
		t.Fatal(err)
	}
	if _, err := s.sh.update(ctx, id, func(lc *lifecycle) error {
		lc.Phase, lc.Finished, lc.Request = phaseFinished, time.Now(), nil
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if n := s.sh.bodies.len(); n != 0 {
		t.Fatalf("%d rollouts' parts held once the lifecycle finished", n)
	}
	for i := range 3 {
		dup := &lifecycle{ID: id, Key: id, Wire: wireV03, Created: time.Now(), Phase: phaseQueued, Request: []byte(fmt.Sprintf("duplicate %d", i))}
		existing, _, err := s.sh.create(ctx, dup)
		if err != nil {
			t.Fatal(err)
		}
		if existing == nil || existing.Phase != phaseFinished {
			t.Fatalf("duplicate %d: found %+v, want the finished lifecycle", i, existing)
		}
		if n := s.sh.bodies.len(); n != 0 {
			t.Errorf("duplicate %d: %d rollouts' parts held after it found the id finished", i, n)
		}
	}
}
