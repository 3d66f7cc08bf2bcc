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
