package rollout

import (
	"encoding/json"
	"sync"
	"time"
)

// localBodies keeps the bodies of a private state's lifecycles (the
// request and the callbacks' payloads) in this process beside them, not in
// them: they are stored so that another replica, or this process after a
// restart, can take the rollout over, and a private state (an embedded
// server in memory) has neither. With the private queue, this is the
// embedded server's only departure from the cluster's path, worth 1.15-1.3x
// the CPU per rollout (`osmo bench rollouts --baseline <build without
// them> --cluster=false`).
//
// Readers see no difference: a lifecycle read back has its bodies put back
// (fill). A body is kept before the write that stores its lifecycle, and
// let go once the lifecycle is finished or removed. What is held belongs to
// one admission of an id, told apart by its lifecycle's Created: an id
// admitted again holds the new admission's bodies.
type localBodies struct {
	mu sync.Mutex
	m  map[string]*rolloutBodies
}

// rolloutBodies is what is held of the admission created at created: its
// request, and its callbacks' payloads by stage and index.
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
// write of lc. What is kept never differs from what was kept before; the
// payloads of done callbacks stay until the rollout is finished.
func (h *localBodies) keep(lc *lifecycle) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keepLocked(lc)
}

// keepNew is keep for a lifecycle being created, unless its id holds
// bodies already; it reports whether it kept them.
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
			// Another admission's bodies are replaced.
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
	for _, name := range stageNames {
		st := lc.stage(name)
		if st == nil {
			continue
		}
		for i, c := range st.Callbacks {
			if len(c.Payload) == 0 {
				continue
			}
			held := entry().stage(name)
			if len(*held) < len(st.Callbacks) {
				*held = append(*held, make([]json.RawMessage, len(st.Callbacks)-len(*held))...)
			}
			(*held)[i] = c.Payload
		}
	}
}

// fill puts back into lc, as read from the state, its request until its
// final stage is owed, and the payloads of its callbacks not done; a
// finished lifecycle's bodies are let go.
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
	for _, name := range stageNames {
		st := lc.stage(name)
		if st == nil {
			continue
		}
		held := *p.stage(name)
		for i := range st.Callbacks {
			if i < len(held) && i < len(st.Done) && !st.Done[i] && len(st.Callbacks[i].Payload) == 0 {
				st.Callbacks[i].Payload = held[i]
			}
		}
	}
}

// forget lets lc's bodies go, unless another admission's are held now.
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
