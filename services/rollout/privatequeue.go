package rollout

import (
	"context"
	"errors"
	"sync"
	"time"
)

// privateQueue is the queue of a private state: the ids of the rollouts
// admitted while every slot was taken, in the order admitted. A private
// state has one replica and ends with its process, so the JetStream queue's
// sharing and takeover have nothing to do; a FIFO here needs no publish,
// pull or acknowledgement per rollout, and holds no slot while empty.
// A rollout is rebuilt from its lifecycle when a slot frees, and started by
// the same compare-and-set write, so a cancel and a start cannot both run it.
type privateQueue struct {
	mu sync.Mutex
	// order is the ids in the order queued; one that no longer waits (its
	// rollout was cancelled) is skipped when it comes up.
	order []string
	// queued says, of every id queued and not done with, whether it waits
	// (true) or was taken (false): an id is queued once.
	queued map[string]bool
	// waiting counts the ids that wait; reserved the places granted to
	// admissions that have not queued yet.
	waiting, reserved int64
	// ready is signalled when an id is queued.
	ready chan struct{}
}

func newPrivateQueue() *privateQueue {
	return &privateQueue{queued: map[string]bool{}, ready: make(chan struct{}, 1)}
}

// reserve grants an admission a place under bound (places reserved count),
// or says the queue is full; either way it says how deep the queue is. A
// place granted is taken by push(id, true), or given back by unreserve.
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

// unreserve gives back a place reserve granted.
func (q *privateQueue) unreserve() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.reserved--
}

// push queues id, in the place reserve granted when reserved, unless it is
// queued already or was taken and runs.
func (q *privateQueue) push(id string, reserved bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if reserved {
		q.reserved--
	}
	if _, ok := q.queued[id]; ok {
		return
	}
	q.queued[id] = true
	q.order = append(q.order, id)
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
	if q.queued[id] {
		delete(q.queued, id)
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
	for q.depth() == 0 {
		select {
		case <-q.ready:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// take is the first id that waits ("" when none does); it stays queued,
// taken, until done.
func (q *privateQueue) take() string {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.order) > 0 {
		id := q.order[0]
		q.order = q.order[1:]
		if q.queued[id] {
			q.queued[id] = false
			q.waiting--
			return id
		}
	}
	// Let go of the backing array a burst grew.
	q.order = nil
	return ""
}

// done ends the membership of an id taken: it ran here, or was found not
// to be queued any more.
func (q *privateQueue) done(id string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if waits, ok := q.queued[id]; ok && !waits {
		delete(q.queued, id)
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
// gives it back), as take starts one from the JetStream queue.
func (s *Service) startPrivate(takeCtx context.Context, q *privateQueue, id string, release func()) {
	ctx, cancel := context.WithTimeout(s.deliverCtx, 10*time.Second)
	defer cancel()
	again := false
	lc, err := s.sh.queuedLifecycle(ctx, id, true)
	switch {
	case err != nil && !errors.Is(err, errGone):
		s.log.Warn("shared state: could not read a queued rollout; it goes back", "rollout_id", id, "error", err)
		release()
		again = true
	case err != nil || lc.Phase != phaseQueued || s.store.get(id) != nil:
		release() // gone, concluded (a cancel), or here already
	default:
		again = s.begin(ctx, lc, nil, "", release)
	}
	q.done(id)
	// A start the state could not write goes back to the queue's end a
	// second later, unless the queue is drained meanwhile.
	if again {
		sleepCtx(takeCtx, time.Second)
		if takeCtx.Err() == nil {
			q.push(id, false)
		}
	}
}
