package rollout

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestActivityMayRiseWhileWaited: work may start while a drain waits (an
// outbox redelivery, a refused start's callbacks), from a count of zero
// too; Wait returns once the count is zero, and never while work it saw
// is under way.
func TestActivityMayRiseWhileWaited(t *testing.T) {
	var a activity
	release := make(chan struct{})
	var running atomic.Int64
	a.Go(func() { running.Add(1); <-release; running.Add(-1) })
	waited := make(chan struct{})
	go func() { a.Wait(); close(waited) }()
	// Starts while it is waited for, from one and from zero, under -race.
	stop := make(chan struct{})
	starters := make(chan struct{})
	go func() {
		defer close(starters)
		for {
			select {
			case <-stop:
				return
			default:
			}
			a.Go(func() {})
		}
	}()
	select {
	case <-waited:
		t.Fatal("Wait returned while a goroutine it counted was running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not return once the count fell to zero")
	}
	close(stop)
	<-starters
	a.Wait()
	if running.Load() != 0 {
		t.Fatal("the counted goroutine had not ended")
	}
}

func TestActivityBelowZeroPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("taking one off a zero count did not panic")
		}
	}()
	var a activity
	a.add(-1)
}
