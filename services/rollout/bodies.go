package rollout

import (
	"encoding/json"
	"sync"
	"time"
)

// localBodies keeps the bodies in a private state's lifecycles
// (natsstore.Store.Private: an embedded server in this process's memory)
// in this process, beside them, instead of in them: the rollout's request
// and the callbacks' payloads.
//
// This and the private queue (privatequeue.go) are the embedded server's
// only departures from the cluster's path, kept because without them osmo
// serve spent 1.15-1.3x the CPU and 1.36x the allocations per rollout
// (`osmo bench rollouts --baseline <build without them> --cluster=false`).
//
// They are in the lifecycle so that whoever takes the rollout over can
// run it, or post its callbacks: another replica, or this process after a
// restart. A private state has neither: no other process reaches it and it
// ends with this one. Every write stores the whole lifecycle, and the
// server copied each write about five times (read buffer, inbound copy,
// store; the next compare-and-set reads it whole again): the grader
// callback's body (every sample, five kilobytes for two LLM calls) and a
// request written three times were a sixth of the bytes osmo serve
// allocated per rollout.
//
// Readers see no difference: a lifecycle read back from the state has its
// bodies put back (fill) as it would have had them stored. A body is kept
// before the write that stores the lifecycle, so no reader finds it
// without, and let go once the lifecycle is finished or removed.
//
// What is held belongs to one admission of an id, told apart by its
// lifecycle's Created: an id admitted again (its finished lifecycle
// expired, or a duplicate raced it) holds the new admission's bodies, and
// neither a read of the old lifecycle nor its last write touches them.
type localBodies struct {
	mu sync.Mutex
	m  map[string]*rolloutBodies
}

// rolloutBodies is what is held of one admission of a rollout (the
// lifecycle created at created): its request, and its callbacks' payloads
// by stage and index.
type rolloutBodies struct {
	created    time.Time
	request    []byte
	ran, final []json.RawMessage
}

// of reports whether p holds the bodies of lc's admission.
func (p *rolloutBodies) of(lc *lifecycle) bool { return p.created.Equal(lc.Created) }

func (p *rolloutBodies) stage(stage string) *[]json.RawMessage {
	if stage == stageRan {
		return &p.ran
	}
	return &p.final
}

// keep holds lc's request and the payloads its stages carry, before a
// write of lc. A rollout's request never changes, and a stage is owed
// once, so what is kept never differs from what was kept before; the
// payloads of done callbacks (dropped from lc) stay until the rollout is
// finished.
func (h *localBodies) keep(lc *lifecycle) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keepLocked(lc)
}

// keepNew is keep for a lifecycle being created, unless its id holds bodies
// already (another admission's, when the id is taken); it reports whether
// it kept them.
func (h *localBodies) keepNew(lc *lifecycle) bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, taken := h.m[lc.ID]; taken {
		return false
	}
	h.keepLocked(lc)
	return true
}

func (h *localBodies) keepLocked(lc *lifecycle) {
	var p *rolloutBodies
	entry := func() *rolloutBodies {
		if p == nil {
			if h.m == nil {
				h.m = map[string]*rolloutBodies{}
			}
			// Another admission's bodies are replaced, not added to:
			// none of them is this one's.
			if p = h.m[lc.ID]; p == nil || !p.of(lc) {
				p = &rolloutBodies{created: lc.Created}
				h.m[lc.ID] = p
			}
		}
		return p
	}
	if len(lc.Request) > 0 {
		entry().request = lc.Request
	}
	for _, s := range lc.stages() {
		if s.st == nil {
			continue
		}
		for i, c := range s.st.Callbacks {
			if len(c.Payload) == 0 {
				continue
			}
			held := entry().stage(s.name)
			if len(*held) < len(s.st.Callbacks) {
				*held = append(*held, make([]json.RawMessage, len(s.st.Callbacks)-len(*held))...)
			}
			(*held)[i] = c.Payload
		}
	}
}

// fill puts back into lc, as read from the state without them, its
// request until its final stage is owed (which drops it), and the
// payloads of its callbacks not done; a finished lifecycle holds neither,
// and its bodies are let go. What another admission of the id holds is
// neither put into lc nor let go.
func (h *localBodies) fill(lc *lifecycle) {
	if h == nil {
		return
	}
	if lc.Phase == phaseFinished {
		h.forget(lc)
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	p := h.m[lc.ID]
	if p == nil || !p.of(lc) {
		return
	}
	if lc.Final == nil && len(lc.Request) == 0 {
		lc.Request = p.request
	}
	for _, s := range lc.stages() {
		if s.st == nil {
			continue
		}
		held := *p.stage(s.name)
		for i := range s.st.Callbacks {
			if i < len(held) && i < len(s.st.Done) && !s.st.Done[i] && len(s.st.Callbacks[i].Payload) == 0 {
				s.st.Callbacks[i].Payload = held[i]
			}
		}
	}
}

// forget lets lc's bodies go (it is finished, or its admission lost its
// id to another), unless another admission's are held now.
func (h *localBodies) forget(lc *lifecycle) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if p := h.m[lc.ID]; p != nil && p.of(lc) {
		delete(h.m, lc.ID)
	}
}

// drop lets id's bodies go, whichever admission's: its lifecycle is gone.
func (h *localBodies) drop(id string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.m, id)
}

// len is how many rollouts have bodies held.
func (h *localBodies) len() int {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.m)
}
