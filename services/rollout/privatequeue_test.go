package rollout

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

func TestPrivateQueue(t *testing.T) {
	q := newPrivateQueue()
	if !q.empty() || q.take() != "" {
		t.Fatal("a new queue is not empty")
	}

	// The bound counts what waits and the places reserved.
	for i := range 2 {
		if room, n := q.reserve(2); !room || n != int64(i) {
			t.Fatalf("reserve %d: room %v at depth %d", i, room, n)
		}
	}
	if room, n := q.reserve(2); room || n != 2 {
		t.Fatalf("a third place under a bound of 2: room %v at depth %d", room, n)
	}
	if q.empty() {
		t.Error("a queue with places reserved reads empty: a start could overtake them")
	}
	q.unreserve()
	q.push("a", true)
	if room, n := q.reserve(2); !room || n != 1 {
		t.Fatalf("one waiting, none reserved: room %v at depth %d", room, n)
	}
	q.unreserve()
	q.push("b", false) // unbounded (a G1 init)
	q.push("a", false) // queued already
	if d := q.depth(); d != 2 {
		t.Fatalf("depth %d, want 2 (a, b)", d)
	}

	// Cancelled while waiting: its place is free at once, and it is skipped.
	q.remove("a")
	if d := q.depth(); d != 1 {
		t.Fatalf("depth %d after a removal, want 1", d)
	}
	q.push("c", false)
	if id := q.take(); id != "b" {
		t.Fatalf("took %q first, want b", id)
	}
	// Taken and not done: running here, not queued again.
	q.push("b", false)
	q.remove("b")
	if id := q.take(); id != "c" {
		t.Fatalf("took %q, want c (b is running)", id)
	}
	if id := q.take(); id != "" {
		t.Fatalf("took %q from an empty queue", id)
	}
	q.done("b")
	q.push("b", false)
	if id := q.take(); id != "b" {
		t.Fatalf("took %q, want b queued again once done", id)
	}
	q.done("b")
	q.done("c")
	if len(q.queued) != 0 {
		t.Errorf("members left: %v", q.queued)
	}
}

// TestPrivateQueueWait: wait returns when something is queued, or when its
// context ends, and not before.
func TestPrivateQueueWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := newPrivateQueue()
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		if err := q.wait(ctx); err == nil {
			t.Fatal("wait on an empty queue returned before its context ended")
		}
		woke := make(chan error, 1)
		go func() { woke <- q.wait(t.Context()) }()
		synctest.Wait()
		select {
		case err := <-woke:
			t.Fatalf("wait returned (%v) with nothing queued", err)
		default:
		}
		q.push("d", false)
		synctest.Wait()
		select {
		case err := <-woke:
			if err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatal("wait did not wake on a push")
		}
		if id := q.take(); id != "d" {
			t.Fatalf("took %q, want d", id)
		}
	})
}
