package osmoopenai

import (
	"runtime"
	"time"

	"github.com/osmo-rl/osmo/internal/gopool"
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
// The calls run on deepCalls' kept goroutines: a new goroutine for each
// call started at 8 KiB and grew twice, copying its stack each time,
// which was 1% of osmo serve's CPU. The calls are CPU work: no more of
// them run at once than there were CPUs to run them at startup, and a
// call waits for one of those.
func offStack(f func()) {
	c := &offCall{f: f, done: make(chan struct{})}
	deepCalls.Go(c.run)
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

// deepCalls keeps the goroutines offStack runs its calls on, each for
// workerIdle after its last call. It is the package's one piece of shared
// state, a cache of goroutines much as a sync.Pool is one of values:
// nothing a caller can observe but the time saved.
var deepCalls = gopool.New(workerIdle, maxDeepCalls)

// workerIdle is how long a kept goroutine waits for another call before it
// ends: under load each takes the next call within microseconds, and once
// the calls stop none is left behind for long.
const workerIdle = time.Second

// maxDeepCalls is the most goroutines deepCalls runs at once.
var maxDeepCalls = max(runtime.GOMAXPROCS(0), 2)
