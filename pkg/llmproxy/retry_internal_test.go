package llmproxy

import (
	"slices"
	"testing"
	"time"
)

// TestRetrySchedule: the upstream retry delays are the G1 client's
// documented schedule exactly, retry_base_delay * 2^attempt capped at
// retry_max_delay (PROTOCOL.md), with no jitter.
func TestRetrySchedule(t *testing.T) {
	s := time.Second
	for _, tc := range []struct {
		name   string
		policy RetryPolicy
		want   []time.Duration
	}{
		{"osmosis defaults", RetryPolicy{BaseDelay: s, MaxDelay: 30 * s}, []time.Duration{s, 2 * s, 4 * s, 8 * s, 16 * s, 30 * s, 30 * s}},
		{"cap reached exactly", RetryPolicy{BaseDelay: 500 * time.Millisecond, MaxDelay: 2 * s}, []time.Duration{500 * time.Millisecond, s, 2 * s, 2 * s}},
		{"no cap: the base delay", RetryPolicy{BaseDelay: s}, []time.Duration{s, s, s}},
		{"cap below the base", RetryPolicy{BaseDelay: 2 * s, MaxDelay: s}, []time.Duration{s, s, s}},
		{"no delay", RetryPolicy{}, []time.Duration{0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.policy.backOff()
			b.Reset()
			got := make([]time.Duration, len(tc.want))
			for i := range got {
				got[i] = b.NextBackOff()
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("delays %v, want %v", got, tc.want)
			}
		})
	}
}
