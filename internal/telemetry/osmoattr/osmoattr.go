// Package osmoattr names osmo's own span attributes and carries the rollout
// and sample ids in W3C baggage, so every span of a rollout, in every
// service, can be tagged with them (see telemetry.BaggageAttributes).
//
// It depends on the OpenTelemetry API only, so the services and the LLM
// proxy can use it without pulling in the SDK.
package osmoattr

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
)

// Attribute keys set by osmo. RolloutID and SampleID are also the names of
// the baggage members that carry the ids between services.
const (
	RolloutID = attribute.Key("osmo.rollout.id")
	SampleID  = attribute.Key("osmo.sample.id")

	// Workflow is the workflow (or agent loop) that ran the rollout.
	Workflow = attribute.Key("osmo.workflow")
	// Wire is the protocol generation that started the rollout (g1, g2,
	// v0.3).
	Wire = attribute.Key("osmo.wire")
	// RolloutStatus is the outcome in the wire's words (G1: COMPLETED or
	// ERROR; G2 and v0.3: success, failure, cancelled).
	RolloutStatus = attribute.Key("osmo.rollout.status")
	// FinishReason is why the agent stopped (stop, max_turns, error, ...).
	FinishReason = attribute.Key("osmo.rollout.finish_reason")
	// ErrorCategory is the rollout's error category (timeout,
	// validation_error, http_error, agent_error, grader_error, cancelled).
	ErrorCategory = attribute.Key("osmo.error.category")
	// QueueWait is how long a rollout waited for a concurrency slot (ms).
	QueueWait = attribute.Key("osmo.rollout.queue_wait_ms")
	// Reward is the reward set on the sample.
	Reward = attribute.Key("osmo.reward")

	// RequestedModel is the model the agent asked for (often the
	// placeholder openai/osmosis-rollout); gen_ai.request.model is the model
	// the call was routed to.
	RequestedModel = attribute.Key("osmo.llm.requested_model")
	// Engine is the base URL of the policy engine a call (or one of its
	// tries, on retry events) went to.
	Engine = attribute.Key("osmo.llm.engine")
	// PolicyVersion is the policy version a call's answer was produced
	// under (set by the pause gate).
	PolicyVersion = attribute.Key("osmo.policy.version")
	// Attempts counts the upstream tries of one LLM call or callback.
	Attempts = attribute.Key("osmo.attempts")
	// Attempt numbers one try (from 1) on retry events.
	Attempt = attribute.Key("osmo.attempt")
	// RetryDelay is the wait before the next try (ms) on retry events.
	RetryDelay = attribute.Key("osmo.retry.delay_ms")

	// GraderName is the grader spec that ran (or was asked for).
	GraderName = attribute.Key("osmo.grader.name")
	// GradeCached reports an answer taken from an earlier grading.
	GradeCached = attribute.Key("osmo.grade.cached")
	// GradeSamples is the number of samples in a grade request.
	GradeSamples = attribute.Key("osmo.grade.samples")
	// RemoveSample is the grader's verdict to drop a sample.
	RemoveSample = attribute.Key("osmo.grade.remove_sample")

	// On a row_drift event: the call (index into the sample's llm_calls)
	// whose prompt parted from the sequence before it, the token index
	// where they part, and the drift's class (reasoning_dropped,
	// tool_call_reserialized, whitespace, other).
	DriftCall     = attribute.Key("osmo.row.drift.call")
	DriftPosition = attribute.Key("osmo.row.drift.position")
	DriftClass    = attribute.Key("osmo.row.drift.class")
)

// ContextWithIDs returns ctx with the rollout id (and the sample id when
// not empty) set as baggage members, keeping the other members. Ids that
// baggage cannot carry are left out.
func ContextWithIDs(ctx context.Context, rolloutID, sampleID string) context.Context {
	bag := baggage.FromContext(ctx)
	changed := false
	for _, kv := range [...]struct{ key, value string }{{string(RolloutID), rolloutID}, {string(SampleID), sampleID}} {
		if kv.value == "" || bag.Member(kv.key).Value() == kv.value {
			continue
		}
		m, err := baggage.NewMemberRaw(kv.key, kv.value)
		if err != nil {
			continue
		}
		if b, err := bag.SetMember(m); err == nil {
			bag, changed = b, true
		}
	}
	if !changed {
		return ctx
	}
	return baggage.ContextWithBaggage(ctx, bag)
}

// IDAttributes returns the rollout and sample id attributes, leaving out
// empty ids.
func IDAttributes(rolloutID, sampleID string) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, 2)
	if rolloutID != "" {
		attrs = append(attrs, RolloutID.String(rolloutID))
	}
	if sampleID != "" {
		attrs = append(attrs, SampleID.String(sampleID))
	}
	return attrs
}
