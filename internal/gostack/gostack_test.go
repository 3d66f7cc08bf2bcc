package gostack

import "testing"

// stackPerGoroutine is the stack each of 200 goroutines holds once it ran
// f.
func stackPerGoroutine(f func()) uint64 { return Held(200, f) }

// A goroutine that reserves holds 16 KiB, not 32, and a call 10 KiB down
// then needs no more either; one that does not starts smaller. (Other
// goroutines' stacks may change meanwhile: the figures are compared to
// halfway between sizes.)
func TestReserveGrowsTo16KiB(t *testing.T) {
	for _, c := range []struct {
		name string
		f    func()
	}{
		{"reserved", Reserve},
		{"reserved, then 10 KiB down", func() { Reserve(); Under(10, func() {}) }},
	} {
		got := stackPerGoroutine(c.f)
		t.Logf("%s: %d KiB of stack per goroutine", c.name, got>>10)
		if got < 12<<10 || got > 24<<10 {
			t.Errorf("%s: %d KiB of stack per goroutine, want 16", c.name, got>>10)
		}
	}
	if got := stackPerGoroutine(func() {}); got > 12<<10 {
		t.Errorf("a goroutine that did not reserve holds %d KiB of stack; the test shows nothing", got>>10)
	}
}

// BenchmarkGrowth: a goroutine going 10 KiB down, its stack grown on the
// way (copied with the frames above it) or reserved first.
func BenchmarkGrowth(b *testing.B) {
	for _, c := range []struct {
		name    string
		reserve bool
	}{{"on the way", false}, {"reserved", true}} {
		b.Run(c.name, func(b *testing.B) {
			done := make(chan struct{})
			for b.Loop() {
				go func() {
					if c.reserve {
						Reserve()
					}
					Under(10, func() {})
					done <- struct{}{}
				}()
				<-done
			}
		})
	}
}
