// Package retry holds the backoff osmo's retry loops share, on
// github.com/cenkalti/backoff/v5: a wait that doubles from a first delay up
// to a cap, spread by the library's symmetric jitter where a loop wants
// one, and the wait of the shared-state loops.
package retry

import (
	"time"

	"github.com/cenkalti/backoff/v5"
)

// Doubling returns a backoff whose waits are base, 2*base, 4*base, …
// capped at max, each spread uniformly over ±jitter of itself (0: the
// schedule exactly, no randomness). A max below base caps from the first
// wait.
func Doubling(base, max time.Duration, jitter float64) *backoff.ExponentialBackOff {
	if max < base {
		base = max
	}
	return &backoff.ExponentialBackOff{InitialInterval: base, Multiplier: 2, MaxInterval: max, RandomizationFactor: jitter}
}

// SharedState is the wait between tries of a read or write of the shared
// state that did not answer (a NATS node restarting, a leader being
// elected): 100 ms doubling to 2 s, no jitter. The loops that use it
// bound it by their own deadline or context.
func SharedState() *backoff.ExponentialBackOff {
	return Doubling(100*time.Millisecond, 2*time.Second, 0)
}

// Nth is b's wait before retry n (from 1), counted from a reset: for
// retries made one at a time rather than by one loop (a message handed
// back with a delay, whose attempt count travels with it).
func Nth(b backoff.BackOff, n int) time.Duration {
	b.Reset()
	d := time.Duration(0)
	for range max(n, 1) {
		if d = b.NextBackOff(); d == backoff.Stop {
			break
		}
	}
	return d
}
