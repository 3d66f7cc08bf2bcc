package retry_test

import (
	"slices"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/retry"
)

func TestSharedState(t *testing.T) {
	ms := time.Millisecond
	b := retry.SharedState()
	b.Reset()
	var got []time.Duration
	for range 7 {
		got = append(got, b.NextBackOff())
	}
	if want := []time.Duration{100 * ms, 200 * ms, 400 * ms, 800 * ms, 1600 * ms, 2000 * ms, 2000 * ms}; !slices.Equal(got, want) {
		t.Errorf("waits %v, want %v", got, want)
	}
	for n, want := range map[int]time.Duration{0: 100 * ms, 1: 100 * ms, 3: 400 * ms, 40: 2 * time.Second} {
		if got := retry.Nth(retry.SharedState(), n); got != want {
			t.Errorf("Nth(%d) = %v, want %v", n, got, want)
		}
	}
}

// TestDoublingJitter: each wait stays within ±jitter of the schedule's.
func TestDoublingJitter(t *testing.T) {
	b := retry.Doubling(100*time.Millisecond, time.Second, 0.2)
	for range 50 {
		b.Reset()
		nominal := 100 * time.Millisecond
		for range 6 {
			d := b.NextBackOff()
			if lo, hi := time.Duration(0.8*float64(nominal)), time.Duration(1.2*float64(nominal))+1; d < lo || d > hi {
				t.Fatalf("wait %v outside [%v, %v]", d, lo, hi)
			}
			nominal = min(2*nominal, time.Second)
		}
	}
}
