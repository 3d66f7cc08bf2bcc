package rollout

import (
	"slices"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/workflows/calculator"
)

// TestCallbackSchedule: with the default settings, callbacks are retried
// on the wires' documented schedules exactly, in the loop and through the
// outbox alike: G2 and v0.3 0.5 s doubling to 8 s (PROTOCOL.md), the G1
// completion OSMOSIS_ROLLOUT_CLIENT_RETRY_BASE_DELAY (1 s) doubling to
// RETRY_MAX_DELAY (30 s).
func TestCallbackSchedule(t *testing.T) {
	cfg := Config{AgentLoop: calculator.Loop{}}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	ms := time.Millisecond
	s := time.Second
	for _, tc := range []struct {
		name   string
		policy callbackPolicy
		want   []time.Duration
	}{
		{"g2", callbackPolicy{BaseDelay: cfg.Callbacks.BaseDelay, MaxDelay: cfg.Callbacks.MaxDelay},
			[]time.Duration{500 * ms, s, 2 * s, 4 * s, 8 * s, 8 * s, 8 * s}},
		{"g1", callbackPolicy{BaseDelay: cfg.Client.RetryBaseDelay, MaxDelay: cfg.Client.RetryMaxDelay},
			[]time.Duration{s, 2 * s, 4 * s, 8 * s, 16 * s, 30 * s, 30 * s}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.policy.backOff()
			b.Reset()
			var loop, outbox []time.Duration
			for i := range tc.want {
				loop = append(loop, b.NextBackOff())
				outbox = append(outbox, tc.policy.delay(i+1))
			}
			if !slices.Equal(loop, tc.want) {
				t.Errorf("waits between attempts %v, want %v", loop, tc.want)
			}
			if !slices.Equal(outbox, tc.want) {
				t.Errorf("outbox redelivery delays %v, want %v", outbox, tc.want)
			}
		})
	}
}
