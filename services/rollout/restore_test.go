package rollout

import (
	"encoding/json"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// TestRestoreFromLifecycle: a replica concluding a rollout it did not
// admit rebuilds its record from the lifecycle alone. Past the final
// stage the request is dropped, so the id and the wire must come from the
// lifecycle: a G1 record rebuilt without its id once handed its
// completion to the outbox under an empty id, where it was dropped, and
// the rollout never ended.
func TestRestoreFromLifecycle(t *testing.T) {
	s := newCalculatorService(t)
	answer, err := proto.Marshal(&rolloutv1.InitRolloutResponse{RolloutId: "g1-a"})
	if err != nil {
		t.Fatal(err)
	}
	v03Request, err := proto.Marshal(&rolloutv1.StartRolloutRequest{RolloutId: "v03-a", LlmApiKey: proto.String("k")})
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name string
		lc   lifecycle
	}{
		{"g1 past its final stage", lifecycle{ID: "g1-a", Key: "key-a", Wire: wireG1, Response: answer, Phase: phaseFinal}},
		{"g2 past its final stage", lifecycle{ID: "g2-a", Key: "g2-a", Wire: wireG2, Phase: phaseFinal}},
		{"v0.3 past its final stage", lifecycle{ID: "v03-b", Key: "v03-b", Wire: wireV03, Phase: phaseFinal}},
		{"v0.3 with its request", lifecycle{ID: "v03-a", Key: "v03-a", Wire: wireV03, Request: v03Request, Phase: phaseRunning}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.lc.Created = created
			rec, err := s.restore(&tc.lc)
			if err != nil {
				t.Fatal(err)
			}
			if rec.id != tc.lc.ID {
				t.Errorf("record id %q, want the lifecycle's %q", rec.id, tc.lc.ID)
			}
			if got := rec.wire.name(); got != tc.lc.Wire {
				t.Errorf("record wire %q, want the lifecycle's %q", got, tc.lc.Wire)
			}
			if !rec.created.Equal(created) {
				t.Errorf("record created %v, want %v", rec.created, created)
			}
		})
	}
}

// TestRestoreTakesTheAdmittedRequest: a lifecycle this replica admitted
// carries its request decoded, and restore takes it as it is (its stored
// bytes here do not decode, so a decode would fail); a lifecycle read from
// the state has none, and its request is decoded. Beginning the rollout
// lets the lifecycle's copy go: the record holds the request then.
func TestRestoreTakesTheAdmittedRequest(t *testing.T) {
	s := newCalculatorService(t)
	req := &rolloutv1.StartRolloutRequest{RolloutId: "g2-a", CompletionCallbackUrl: "http://127.0.0.1:1/done"}
	lc := &lifecycle{ID: "g2-a", Key: "g2-a", Wire: wireG2, Request: []byte("not a request"), Phase: phaseQueued, admitted: req}
	rec, err := s.restore(lc)
	if err != nil {
		t.Fatalf("restore with the admitted request: %v", err)
	}
	if w, ok := rec.wire.(*g2Wire); !ok || w.req != req {
		t.Errorf("record's request is not the admitted one: %#v", rec.wire)
	}
	rec.release()
	lc.admitted = nil
	if _, err := s.restore(lc); err == nil {
		t.Error("restore decoded a request that does not decode")
	}
	// Stored and read back, a lifecycle has no admitted request.
	var read lifecycle
	if err := json.Unmarshal(mustEncode(t, lc, true), &read); err != nil {
		t.Fatal(err)
	}
	if read.admitted != nil {
		t.Error("the admitted request went into the stored lifecycle")
	}
}

// mustEncode is lc as encode encodes it.
func mustEncode(t *testing.T, lc *lifecycle, inline bool) []byte {
	t.Helper()
	b, err := lc.encode(inline)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
