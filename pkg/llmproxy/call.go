package llmproxy

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/retry"
)

// APIChatCompletions is osmo.LLMCall.API for chat completions calls.
const APIChatCompletions = "chat.completions"

// Header names that bind a call to a rollout and a sample.
const (
	HeaderRolloutID = "X-Rollout-Id"
	HeaderSampleID  = "X-Sample-Id"
)

// Recorder receives every finished call, failed ones included. It must be
// safe for concurrent use and must not block for long.
type Recorder interface {
	RecordCall(ctx context.Context, c *osmo.LLMCall)
}

// RecorderFunc adapts a function to Recorder.
type RecorderFunc func(ctx context.Context, c *osmo.LLMCall)

// RecordCall calls f.
func (f RecorderFunc) RecordCall(ctx context.Context, c *osmo.LLMCall) { f(ctx, c) }

// RetryPolicy is the G1 client retry rule: 5xx, timeouts and transport errors
// (but permanent ones, see Config.Transport) are retried up to MaxRetries times with delay BaseDelay*2^attempt capped at
// MaxDelay (a MaxDelay of 0 keeps every delay at BaseDelay), exactly, as the
// Osmosis G1 client waits; a 4xx fails at once.
type RetryPolicy struct {
	MaxRetries int
	BaseDelay  time.Duration
	MaxDelay   time.Duration
}

// backOff is the policy's schedule of delays: BaseDelay doubling up to
// MaxDelay, without jitter.
func (p RetryPolicy) backOff() *backoff.ExponentialBackOff {
	limit := p.MaxDelay
	if limit == 0 {
		limit = p.BaseDelay
	}
	return retry.Doubling(p.BaseDelay, limit, 0)
}
