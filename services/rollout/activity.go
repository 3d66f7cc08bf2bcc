package rollout

import "sync"

// activity counts the goroutines a drain waits for. Unlike a
// sync.WaitGroup's, its count may rise from zero while it is waited for (an
// outbox redelivery starting during the drain); Wait returns at a moment it
// is zero, and what starts after is cut short with the delivery context.
type activity struct {
	mu    sync.Mutex
	n     int
	zeros uint64     // how many times n fell to zero
	zero  *sync.Cond // signalled when it does; made on first use
}

func (a *activity) add(delta int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.n += delta
	switch {
	case a.n < 0:
		panic("rollout: activity count below zero")
	case a.n == 0:
		a.zeros++
		if a.zero != nil {
			a.zero.Broadcast()
		}
	}
}

// Go runs f in a goroutine counted until f returns.
func (a *activity) Go(f func()) {
	a.add(1)
	go func() {
		defer a.add(-1)
		f()
	}()
}

// Wait blocks until the count is zero, or has been since Wait was called:
// work that keeps starting does not keep it waiting.
func (a *activity) Wait() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.zero == nil {
		a.zero = sync.NewCond(&a.mu)
	}
	for seen := a.zeros; a.n > 0 && a.zeros == seen; {
		a.zero.Wait()
	}
}
