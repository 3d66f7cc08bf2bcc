package osmoopenai

import (
	"runtime"
	"time"
)

// offStack runs f on another goroutine and waits for it; a panic in f is
// raised again in the caller.
//
// For the openai-go calls that need a deep stack. A rollout's goroutine
// runs its workflow and, through the in-process proxy, waits for the
// policy about 10 KiB down; a call that needs more than the 6 KiB left
// doubles its stack to 32 KiB, and the runtime does not halve it again
// while the goroutine uses more than a quarter of it: the rollout would
// hold the 32 KiB for as long as it waits, 16 KiB more per rollout in
// flight (docs/performance.md).
//
// The goroutines that run the calls are kept while calls keep coming (see
// deepWorker): a new goroutine for each call started at 8 KiB and grew
// twice, copying its stack each time, which was 1% of osmo serve's CPU.
// The calls are CPU work: no more of them run at once than there were
// CPUs to run them at startup, and a call waits for one of those.
func offStack(f func()) {
	c := &offCall{f: f, done: make(chan struct{})}
	select {
	case offCalls <- c:
	default:
		select {
		case offCalls <- c:
		case workerSlots <- struct{}{}:
			go deepWorker(c)
		}
	}
	<-c.done
	if c.panicked != nil {
		panic(c.panicked)
	}
}

// offCall is one call of offStack.
type offCall struct {
	f        func()
	done     chan struct{}
	panicked any
}

func (c *offCall) run() {
	defer close(c.done)
	defer func() { c.panicked = recover() }()
	c.f()
}

// offCalls hands a call to an idle deepWorker, and workerSlots holds one
// token per worker. They are the package's one piece of shared state, a
// cache of goroutines much as a sync.Pool is one of values: nothing a
// caller can observe but the time saved.
var (
	offCalls    = make(chan *offCall)
	workerSlots = make(chan struct{}, max(runtime.GOMAXPROCS(0), 2))
)

// workerIdle is how long a deepWorker waits for another call before it
// ends: under load each takes the next call within microseconds, and once
// the calls stop none is left behind for long.
const workerIdle = time.Second

// deepWorker runs c and then every call handed to it, until none comes for
// workerIdle. Its stack stays grown between calls, though the garbage
// collector may halve it while it waits.
func deepWorker(c *offCall) {
	defer func() { <-workerSlots }()
	t := time.NewTimer(workerIdle)
	defer t.Stop()
	for {
		c.run()
		t.Reset(workerIdle)
		select {
		case c = <-offCalls:
		case <-t.C:
			return
		}
	}
}
