// Package gostack grows a goroutine's stack before it is deep.
//
// A goroutine starts with a small stack (the runtime's average of what
// goroutines used, often 8 KiB) and the runtime doubles it when a call
// needs more: it copies the stack in use and adjusts every frame in it,
// so a stack grown 8 KiB down in a chain of fifty calls costs several
// microseconds. The work of a rollout's goroutines (writing its lifecycle,
// an LLM call through the in-process proxy, a tool's JSON decoding, a
// callback's HTTP request, a grading) grows each of them to 16 KiB; grown
// as the goroutine starts, there is next to nothing to copy. Those
// growths were 2-3% of osmo serve's CPU (docs/performance.md).
package gostack

import "runtime"

// reserve is the frame Reserve takes: with the little a goroutine has used
// when it starts, the runtime grows the stack to 16 KiB and no further.
const reserve = 10 << 10

// Reserve grows the calling goroutine's stack to 16 KiB, if it is smaller.
// Call it first thing in a goroutine that will need that much anyway: it
// costs a goroutine that would not have needed it 8 KiB more for as long as
// it lives.
//
//go:noinline
func Reserve() {
	var frame [reserve]byte
	keep(frame[:])
}

// keep keeps Reserve's frame from being optimized away.
//
//go:noinline
func keep([]byte) {}

// Held is the goroutine stack, in bytes, that each of n goroutines holds
// once it has run f and waits: what a rollout parked in a call keeps. It
// is for tests that hold a path to a stack size; other goroutines' stacks
// may change while it counts, so compare it to halfway between sizes.
func Held(n int, f func()) uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.StackInuse
	wait, ran := make(chan struct{}), make(chan struct{}, n)
	for range n {
		go func() {
			f()
			ran <- struct{}{}
			<-wait
		}()
	}
	for range n {
		<-ran
	}
	runtime.ReadMemStats(&ms)
	close(wait)
	return (ms.StackInuse - before) / uint64(n)
}

// Under calls f under about n KiB of frames, as a call deep in a workflow
// is (a rollout's goroutine waits for the policy about 10 KiB down). For
// tests, with Held.
func Under(n int, f func()) {
	under(n, f)
}

//go:noinline
func under(n int, f func()) byte {
	var frame [1000]byte
	if n <= 0 {
		f()
		return frame[0]
	}
	frame[n%len(frame)] = byte(n)
	return under(n-1, f) + frame[(n+1)%len(frame)]
}
