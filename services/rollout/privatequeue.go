package rollout

import (
	"context"
	"errors"
	"sync"
	"time"
)

// privateQueue is the queue of a private state: the rollouts admitted
// while every slot was taken, in the order admitted, held in this process.
//
// The JetStream queue is there so that replicas share work and take over
// a lost replica's rollouts. A private state has one replica and does not
// outlive its process, so neither arises; what is left is a bounded FIFO
// of ids, which needs no publish, pull, delivery or acknowledgement per
// rollout, and holds no slot while it is empty (the JetStream taker holds
// a batch of free slots in each pull, which a start could have used).
//
// Like the JetStream queue it holds ids: the rollout is rebuilt from its
// lifecycle when a slot frees, and the write that starts it is the same
// compare-and-set, so a cancel (which concludes a queued rollout through
// the control queue) and a start cannot both run it.
type privateQueue struct {
	mu sync.Mutex
	// order is the queue, first to start first; an entry whose rollout
	// was cancelled while waiting is skipped.
	order []*queuedID
	// members are the ids in order and those taken from it and not yet
	// done with (started, they run here): an id is queued once.
	members map[string]*queuedID
	// waiting counts the entries of order not skipped; reserved the
	// places granted to admissions that have not queued yet.
	waiting, reserved int64
	// ready is signalled when an entry is queued.
	ready chan struct{}
}

type queuedID struct {
	id      string
	skipped bool
	taken   bool
}

func newPrivateQueue() *privateQueue {
	return &privateQueue{members: map[string]*queuedID{}, ready: make(chan struct{}, 1)}
}

// reserve grants an admission a place under bound (the queue's depth,
// places reserved included), or says the queue is full and how deep it
// is. A place granted is taken by push(id, true), or given back by
// unreserve.
func (q *privateQueue) reserve(bound int64) (room bool, n int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	n = q.waiting + q.reserved
	if n >= bound {
		return false, n
	}
	q.reserved++
	return true, n
}

// unreserve gives back a place reserve granted, for an admission that
// queued nothing.
func (q *privateQueue) unreserve() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.reserved--
}

// push queues id, in the place reserve granted when reserved. An id
// queued already, or started from the queue and running, is not queued
// twice.
func (q *privateQueue) push(id string, reserved bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if reserved {
		q.reserved--
	}
	if _, ok := q.members[id]; ok {
		return
	}
	e := &queuedID{id: id}
	q.members[id] = e
	q.order = append(q.order, e)
	q.waiting++
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// remove takes id out of the queue if it waits there (a cancelled
// rollout, concluded without a slot): its place is free at once.
func (q *privateQueue) remove(id string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if e, ok := q.members[id]; ok && !e.taken {
		e.skipped = true
		delete(q.members, id)
		q.waiting--
	}
}

// empty reports whether nothing waits, nor is about to.
func (q *privateQueue) empty() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.waiting+q.reserved == 0
}

// depth is how many rollouts wait.
func (q *privateQueue) depth() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.waiting
}

// wait returns once a rollout waits, or ctx ended.
func (q *privateQueue) wait(ctx context.Context) error {
	for {
		q.mu.Lock()
		n := q.waiting
		q.mu.Unlock()
		if n > 0 {
			return nil
		}
		select {
		case <-q.ready:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// take is the first rollout that waits ("" when none does): it stays a
// member until done.
func (q *privateQueue) take() string {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.order) > 0 {
		e := q.order[0]
		q.order[0] = nil
		q.order = q.order[1:]
		if e.skipped {
			continue
		}
		e.taken = true
		q.waiting--
		return e.id
	}
	// Let go of the backing array a burst grew.
	q.order = nil
	return ""
}

// done ends id's membership: taken from the queue, it ran here, or
// was found not to be queued any more.
func (q *privateQueue) done(id string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if e, ok := q.members[id]; ok && e.taken {
		delete(q.members, id)
	}
}

// takePrivate starts the rollouts of a private state's queue, each when a
// slot frees, in the order queued, until ctx ends. It takes a slot only
// once a rollout waits, so an idle queue holds none.
func (s *Service) takePrivate(ctx context.Context, q *privateQueue) {
	for {
		if q.wait(ctx) != nil {
			return
		}
		release, err := s.acquire(ctx)
		if err != nil {
			return
		}
		id := q.take()
		if id == "" {
			// Cancelled while this waited for the slot.
			release()
			continue
		}
		s.wg.Go(func() { s.startPrivate(ctx, q, id, release) })
	}
}

// startPrivate starts id, taken from the private queue in a slot (release
// gives it back), as take starts one from the JetStream queue. A start the
// state could not write goes back to the queue's end, a second later.
func (s *Service) startPrivate(takeCtx context.Context, q *privateQueue, id string, release func()) {
	ctx, cancel := context.WithTimeout(s.deliverCtx, 10*time.Second)
	defer cancel()
	again := false
	defer func() {
		q.done(id)
		if !again {
			return
		}
		t := time.NewTimer(time.Second)
		defer t.Stop()
		select {
		case <-t.C:
			q.push(id, false)
		case <-takeCtx.Done():
			// The queue is not taken from any more (a drain).
		}
	}()
	lc, err := s.sh.queuedLifecycle(ctx, id, true)
	switch {
	case errors.Is(err, errGone):
		release()
		return
	case err != nil:
		s.log.Warn("shared state: could not read a queued rollout; it goes back", "rollout_id", id, "error", err)
		release()
		again = true
		return
	}
	if lc.Phase != phaseQueued || s.store.get(id) != nil {
		// Concluded (a cancel), or here already.
		release()
		return
	}
	again = s.begin(ctx, lc, nil, "", release)
}
