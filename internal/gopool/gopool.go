// Package gopool runs functions on goroutines it keeps for a while after
// each call returns.
//
// A new goroutine starts with a small stack and grows it, copying it each
// time, as deep calls need more: for short CPU work that goes deep every
// time (openai-go's decoder and encoder) the copies are a measurable share
// of the CPU. A goroutine kept for the next call keeps the stack it grew.
// Kept goroutines end once no call has come for the pool's idle time, so a
// burst leaves nothing behind for long.
//
// Not for work that then waits long: a kept goroutine's stack is as large
// as the deepest call it ran, and work parked on it holds all of that.
// Rollouts run on kept goroutines held 32 KiB of stack each while waiting
// for the policy instead of 16, and osmo serve's RSS with 100 held rose
// by a tenth, for no CPU saved.
package gopool

import (
	"sync/atomic"
	"time"
)

// Pool runs functions on goroutines it keeps. The zero Pool is not usable;
// make one with New.
type Pool struct {
	idle  time.Duration
	calls chan func()
	slots chan struct{} // one token per goroutine, when bounded
	live  atomic.Int64
}

// New returns a pool whose goroutines end after idle without a call. With
// max > 0 at most max run at once, and Go waits for one while they all
// do; with max <= 0, Go never waits.
func New(idle time.Duration, max int) *Pool {
	p := &Pool{idle: idle, calls: make(chan func())}
	if max > 0 {
		p.slots = make(chan struct{}, max)
	}
	return p
}

// Go runs f on a goroutine of the pool: an idle one, or a new one. A panic
// in f is not recovered (as with the go statement).
func (p *Pool) Go(f func()) {
	select {
	case p.calls <- f:
		return
	default:
	}
	if p.slots == nil {
		p.start(f)
		return
	}
	select {
	case p.calls <- f:
	case p.slots <- struct{}{}:
		p.start(f)
	}
}

// Live is how many goroutines the pool has now, busy or idle.
func (p *Pool) Live() int { return int(p.live.Load()) }

func (p *Pool) start(f func()) {
	p.live.Add(1)
	go p.work(f)
}

// work runs f and then every call handed to it, until none comes for the
// pool's idle time. Its stack stays grown between calls, though the
// garbage collector may halve it while it waits.
func (p *Pool) work(f func()) {
	defer func() {
		p.live.Add(-1)
		if p.slots != nil {
			<-p.slots
		}
	}()
	t := time.NewTimer(p.idle)
	defer t.Stop()
	for {
		f()
		t.Reset(p.idle)
		select {
		case f = <-p.calls:
		case <-t.C:
			return
		}
	}
}
