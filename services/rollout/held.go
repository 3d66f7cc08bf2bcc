package rollout

import (
	"encoding/json"
	"sync"
	"time"
)

// heldParts keeps the larger parts of a private state's lifecycles
// (natsstore.Store.Private: an embedded server in this process's memory)
// in this process, beside them, instead of in them: the rollout's request
// and the callbacks' payloads.
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
// parts put back (fill) as it would have had them stored. A part is kept
// before the write that stores the lifecycle, so no reader finds it
// without, and let go once the lifecycle is finished or removed.
//
// What is held belongs to one admission of an id, told apart by its
// lifecycle's Created: an id admitted again (its finished lifecycle
// expired, or a duplicate raced it) holds the new admission's parts, and
// neither a read of the old lifecycle nor its last write touches them.
type heldParts struct {
	mu sync.Mutex
	m  map[string]*heldLifecycle
}

// heldLifecycle is what is held of one admission of a rollout (the
// lifecycle created at created): its request, and its callbacks' payloads
// by stage and index.
type heldLifecycle struct {
	created    time.Time
	request    []byte
	ran, final []json.RawMessage
}

// of reports whether p holds lc's admission's parts.
func (p *heldLifecycle) of(lc *lifecycle) bool { return p.created.Equal(lc.Created) }

func (p *heldLifecycle) stage(stage string) *[]json.RawMessage {
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
func (h *heldParts) keep(lc *lifecycle) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keepLocked(lc)
}

// keepNew is keep for a lifecycle being created, unless its id holds parts
// already (another admission's, when the id is taken); it reports whether
// it kept them.
func (h *heldParts) keepNew(lc *lifecycle) bool {
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

func (h *heldParts) keepLocked(lc *lifecycle) {
	var p *heldLifecycle
	entry := func() *heldLifecycle {
		if p == nil {
			if h.m == nil {
				h.m = map[string]*heldLifecycle{}
			}
			// Another admission's parts are replaced, not added to:
			// none of them is this one's.
			if p = h.m[lc.ID]; p == nil || !p.of(lc) {
				p = &heldLifecycle{created: lc.Created}
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
// and its parts are let go. What another admission of the id holds is
// neither put into lc nor let go.
func (h *heldParts) fill(lc *lifecycle) {
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

// forget lets lc's parts go (it is finished, or its admission lost its
// id to another), unless another admission's are held now.
func (h *heldParts) forget(lc *lifecycle) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if p := h.m[lc.ID]; p != nil && p.of(lc) {
		delete(h.m, lc.ID)
	}
}

// drop lets id's parts go, whichever admission's: its lifecycle is gone.
func (h *heldParts) drop(id string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.m, id)
}

// len is how many rollouts have parts held.
func (h *heldParts) len() int {
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.m)
}
