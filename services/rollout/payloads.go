package rollout

import (
	"encoding/json"
	"sync"
)

// heldPayloads keeps the callbacks' payloads of a private state
// (natsstore.Store.Private: an embedded server in this process's memory)
// in this process, beside the lifecycles, instead of in them.
//
// A payload is in the lifecycle so that whoever concludes the rollout next
// can post it: another replica, or this process after a restart. A
// private state has neither: no other process reaches it and it ends with
// this one. Stored there, the grader callback's body (every sample, five
// kilobytes for two LLM calls) was copied about five times by the server
// for each write that carried it, and read whole again by the next write's
// compare-and-set: an eighth of the bytes osmo serve allocated per rollout.
//
// Readers see no difference: a lifecycle read back from the state has the
// payloads of its callbacks not done put back (fill), as it would have
// had them stored. A payload is kept before the write that stores its
// stage, so no reader finds the stage without it, and let go once the
// lifecycle is finished or gone.
type heldPayloads struct {
	mu sync.Mutex
	m  map[string]*stagePayloads
}

// stagePayloads are one rollout's payloads, by stage and callback index.
type stagePayloads struct {
	ran, final []json.RawMessage
}

func (p *stagePayloads) of(stage string) *[]json.RawMessage {
	if stage == stageRan {
		return &p.ran
	}
	return &p.final
}

// keep holds the payloads lc's stages carry. A stage is owed once, so a
// payload kept for a callback never differs from one kept before; those
// of done callbacks (dropped from lc) stay until the rollout is finished.
func (h *heldPayloads) keep(lc *lifecycle) {
	if h == nil || (lc.Ran == nil && lc.Final == nil) {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range []struct {
		name string
		st   *owedStage
	}{{stageRan, lc.Ran}, {stageFinal, lc.Final}} {
		if s.st == nil {
			continue
		}
		for i, c := range s.st.Callbacks {
			if len(c.Payload) == 0 {
				continue
			}
			if h.m == nil {
				h.m = map[string]*stagePayloads{}
			}
			p := h.m[lc.ID]
			if p == nil {
				p = &stagePayloads{}
				h.m[lc.ID] = p
			}
			held := p.of(s.name)
			if len(*held) < len(s.st.Callbacks) {
				*held = append(*held, make([]json.RawMessage, len(s.st.Callbacks)-len(*held))...)
			}
			(*held)[i] = c.Payload
		}
	}
}

// fill puts back the payloads of lc's callbacks not done, as read from the
// state without them; a finished lifecycle owes none, and its payloads
// are let go.
func (h *heldPayloads) fill(lc *lifecycle) {
	if h == nil {
		return
	}
	if lc.Phase == phaseFinished {
		h.forget(lc.ID)
		return
	}
	if lc.Ran == nil && lc.Final == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	p := h.m[lc.ID]
	if p == nil {
		return
	}
	for _, s := range []struct {
		name string
		st   *owedStage
	}{{stageRan, lc.Ran}, {stageFinal, lc.Final}} {
		if s.st == nil {
			continue
		}
		held := *p.of(s.name)
		for i := range s.st.Callbacks {
			if i < len(held) && i < len(s.st.Done) && !s.st.Done[i] && len(s.st.Callbacks[i].Payload) == 0 {
				s.st.Callbacks[i].Payload = held[i]
			}
		}
	}
}

// forget lets id's payloads go: its lifecycle is finished or gone.
func (h *heldPayloads) forget(id string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.m, id)
}

// len is how many rollouts have payloads held.
func (h *heldPayloads) len() int {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.m)
}
