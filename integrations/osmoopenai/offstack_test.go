package osmoopenai

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestOffStackBoundsItsWorkers: calls made together all run, no more of
// them at once than there are workers, and their goroutines end once the
// calls stop.
func TestOffStackBoundsItsWorkers(t *testing.T) {
	var running, most atomic.Int64
	var wg sync.WaitGroup
	done := make(chan struct{})
	for range 64 {
		wg.Go(func() {
			offStack(func() {
				n := running.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				time.Sleep(time.Millisecond)
				running.Add(-1)
			})
		})
	}
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("64 calls made together did not all return")
	}
	if m := most.Load(); m > int64(maxDeepCalls) {
		t.Errorf("%d calls ran at once, want at most %d", m, maxDeepCalls)
	}
	deadline := time.Now().Add(workerIdle + 5*time.Second)
	for deepCalls.Live() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines still there %v after the calls stopped", deepCalls.Live(), workerIdle+5*time.Second)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
