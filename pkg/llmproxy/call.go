package llmproxy

import (
	"context"
	"encoding/json"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/osmo-rl/osmo/internal/retry"
)

// APIChatCompletions is Call.API for chat completions calls.
const APIChatCompletions = "chat.completions"

// Header names that bind a call to a rollout and a sample.
const (
	HeaderRolloutID = "X-Rollout-Id"
	HeaderSampleID  = "X-Sample-Id"
)

// Call is the record of one chat completion that went through the proxy.
// Message fields hold the JSON exactly as it crossed the wire.
type Call struct {
	RolloutID string
	SampleID  string

	// API is the API the client called: APIChatCompletions, or
	// APIResponses for a Responses call the proxy translated (the upstream
	// always receives a chat completion, which is what the record holds).
	API string

	// ID is the upstream response id.
	ID string
	// RequestedModel is what the client asked for; Model what went upstream.
	RequestedModel string
	Model          string
	// RequestMessages is the request's "messages" array.
	RequestMessages json.RawMessage
	// ResponseMessage is choices[0].message (assembled from deltas for a stream).
	ResponseMessage json.RawMessage
	FinishReason    string
	Usage           Usage
	Stream          bool

	StartedAt        time.Time
	Latency          time.Duration
	TimeToFirstToken time.Duration

	// Exact tokens and log probabilities, when the upstream returned them.
	PromptTokenIDs     []int32
	CompletionTokenIDs []int32
	Logprobs           []float64

	// StatusCode is what the proxy answered; Err is set when the call failed.
	StatusCode int
	Err        string
	// Attempts counts upstream tries.
	Attempts int
}

// Usage is the upstream's token accounting.
type Usage struct {
	PromptTokens     int
	CompletionTokens int
	TotalTokens      int
	CachedTokens     int
}

// Recorder receives every finished call, failed ones included. It must be
// safe for concurrent use and must not block for long.
type Recorder interface {
	RecordCall(ctx context.Context, c *Call)
}

// RecorderFunc adapts a function to Recorder.
type RecorderFunc func(ctx context.Context, c *Call)

// RecordCall calls f.
func (f RecorderFunc) RecordCall(ctx context.Context, c *Call) { f(ctx, c) }

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
