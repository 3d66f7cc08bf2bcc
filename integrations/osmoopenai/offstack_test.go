package osmoopenai

import (
	"bytes"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// goroutineID is the id runtime.Stack prints for the calling goroutine.
func goroutineID(t *testing.T) uint64 {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	f := bytes.Fields(buf)
	if len(f) < 2 {
		t.Fatalf("no goroutine id in %q", buf)
	}
	id, err := strconv.ParseUint(string(f[1]), 10, 64)
	if err != nil {
		t.Fatalf("no goroutine id in %q: %v", buf, err)
	}
	return id
}

// TestOffStackReusesItsGoroutines: calls made one after another run on the
// goroutines kept for them, not on a new one each (whose stack grows
// again, copied each time), and a panic does not lose the goroutine it
// ran on.
func TestOffStackReusesItsGoroutines(t *testing.T) {
	caller := goroutineID(t)
	ids := map[uint64]bool{}
	for i := range 200 {
		if i%50 == 0 {
			func() {
				defer func() { _ = recover() }()
				offStack(func() { panic("boom") })
			}()
		}
		offStack(func() { ids[goroutineID(t)] = true })
	}
	if ids[caller] {
		t.Fatal("a call ran on the caller's goroutine")
	}
	if len(ids) > maxDeepCalls {
		t.Errorf("200 calls in turn ran on %d goroutines, want at most %d", len(ids), maxDeepCalls)
	}
}

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
