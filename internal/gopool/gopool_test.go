package gopool

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
func goroutineID() uint64 {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	f := bytes.Fields(buf)
	if len(f) < 2 {
		return 0
	}
	id, _ := strconv.ParseUint(string(f[1]), 10, 64)
	return id
}

// TestCallsInTurnShareAGoroutine: calls made one after another run on the
// goroutines kept from the first ones (a call made as the last returns may
// find its goroutine not yet waiting, and take another), which end once
// the calls stop.
func TestCallsInTurnShareAGoroutine(t *testing.T) {
	p := New(100*time.Millisecond, 0)
	ids := map[uint64]bool{}
	for range 100 {
		done := make(chan struct{})
		p.Go(func() { ids[goroutineID()] = true; close(done) })
		<-done
	}
	if len(ids) > 5 {
		t.Errorf("100 calls in turn ran on %d goroutines, want a few", len(ids))
	}
	waitIdle(t, p)
}

// TestUnboundedNeverWaits: with no bound, calls made while every goroutine
// is busy each get a new one.
func TestUnboundedNeverWaits(t *testing.T) {
	p := New(100*time.Millisecond, 0)
	release := make(chan struct{})
	var started sync.WaitGroup
	for range 20 {
		started.Add(1)
		p.Go(func() { started.Done(); <-release })
	}
	waited := make(chan struct{})
	go func() { started.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		t.Fatal("20 blocking calls did not all start")
	}
	if n := p.Live(); n != 20 {
		t.Errorf("%d goroutines for 20 blocking calls, want 20", n)
	}
	close(release)
	waitIdle(t, p)
}

// TestBoundedRunsAtMostMax: with a bound, no more calls run at once than
// it allows, and every call runs.
func TestBoundedRunsAtMostMax(t *testing.T) {
	p := New(100*time.Millisecond, 3)
	var running, most atomic.Int64
	var wg sync.WaitGroup
	for range 60 {
		wg.Add(1)
		p.Go(func() {
			defer wg.Done()
			n := running.Add(1)
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
			time.Sleep(time.Millisecond)
			running.Add(-1)
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("60 calls did not all run")
	}
	if m := most.Load(); m > 3 {
		t.Errorf("%d calls ran at once, want at most 3", m)
	}
	waitIdle(t, p)
}

// waitIdle waits for p's goroutines to end after their idle time.
func waitIdle(t *testing.T, p *Pool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for p.Live() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines left 5 s after the calls stopped (idle time %v)", p.Live(), p.idle)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
