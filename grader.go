package osmo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"
)

// Grader sets rewards on the samples of one finished rollout. Implementations
// must be safe for concurrent use.
type Grader interface {
	Grade(ctx context.Context, gc *GraderContext) error
}

// GraderFunc adapts a function to Grader.
type GraderFunc func(ctx context.Context, gc *GraderContext) error

// Grade calls f.
func (f GraderFunc) Grade(ctx context.Context, gc *GraderContext) error { return f(ctx, gc) }

// Sample is a finished sample (the Osmosis RolloutSample) as a grader
// sees it: its messages, metadata and extra fields decoded from the JSON
// the agent and the trainer sent.
type Sample struct {
	ID string
	// Messages are the conversation as the agent framework shaped it.
	Messages []Message
	Label    *string
	Metadata map[string]any
	// Reward is the reward from an earlier grading, if any; a grader sets
	// rewards through GraderContext.SetSampleReward.
	Reward *float64
	// RemoveSample is the remove flag from an earlier grading.
	RemoveSample bool
	Metrics      *SampleMetrics
	ExtraFields  map[string]any
	// LLMCalls are the sample's calls through the LLM proxy, in order, as
	// recorded: read them, do not change them.
	LLMCalls []*LLMCall
	// AgentReward is the reward the workflow proposed, if any.
	AgentReward *float64
	// FinishReason is why the agent stopped.
	FinishReason string
}

// SampleMetrics are the counters of a sample (or of a whole rollout), under
// the names of the G1 completion's metrics.
type SampleMetrics struct {
	TotalLatencyMS   float64 `json:"total_latency_ms"`
	LLMLatencyMS     float64 `json:"llm_latency_ms"`
	ToolLatencyMS    float64 `json:"tool_latency_ms"`
	NumLLMCalls      int     `json:"num_llm_calls"`
	NumToolCalls     int     `json:"num_tool_calls"`
	PromptTokens     int     `json:"prompt_tokens"`
	ResponseTokens   int     `json:"response_tokens"`
	MaxContextTokens int     `json:"max_context_tokens"`
}

// LLMCall is the record of one chat completion that went through the LLM
// proxy: the proxy fills it in, a rollout keeps it with its sample, graders
// read it, and the stored record, the API and the callbacks render it. The
// messages are the JSON exactly as it crossed the wire.
type LLMCall struct {
	// RolloutID and SampleID bind the call to its sample (the proxy reads
	// them from the request's headers); a sample's calls do not repeat them.
	RolloutID string `json:"-"`
	SampleID  string `json:"-"`

	// ID is the upstream response id.
	ID string `json:"id"`
	// RequestedModel is what the client asked for; Model what went upstream.
	RequestedModel string `json:"requested_model"`
	Model          string `json:"model"`
	// SharedRequestMessages counts the leading messages the request shares
	// with the previous call of its sample, and RequestMessages are the
	// request's messages after those: a call's whole request is the first
	// SharedRequestMessages messages of the previous call's whole request,
	// then its RequestMessages. A call the proxy records stands alone
	// (0, every message); a rollout counts what its sample's calls share,
	// so that they do not each copy the conversation.
	SharedRequestMessages int               `json:"shared_request_messages"`
	RequestMessages       []json.RawMessage `json:"request_messages"`
	// ResponseMessage is choices[0].message (assembled from deltas for a stream).
	ResponseMessage json.RawMessage `json:"response_message"`
	FinishReason    string          `json:"finish_reason"`
	Usage           Usage           `json:"usage"`
	// LatencyMS is the wall time from the proxy receiving the request to
	// the last byte answered; TimeToFirstTokenMS, for a stream, to the
	// first content chunk.
	LatencyMS          float64 `json:"latency_ms"`
	TimeToFirstTokenMS float64 `json:"time_to_first_token_ms"`
	Stream             bool    `json:"stream"`
	// Exact tokens and per-token log probabilities, when the policy
	// returned them.
	PromptTokenIDs     []int32   `json:"prompt_token_ids,omitempty"`
	CompletionTokenIDs []int32   `json:"completion_token_ids,omitempty"`
	Logprobs           []float64 `json:"logprobs,omitempty"`
	// CompletionTokenStrings are the completion's tokens as text, one per
	// CompletionTokenIDs entry, as the policy's logprobs name them: where
	// a later prompt parts from this completion, they say what changed.
	CompletionTokenStrings []string `json:"completion_token_strings,omitempty"`
	// NoTokensReason says why the call has no token ids when it has none
	// (the policy refused the token parameters, or returned none).
	NoTokensReason string `json:"no_tokens_reason,omitempty"`
	// StatusCode is what the proxy answered; Error is set when the call failed.
	StatusCode int    `json:"status_code"`
	Error      string `json:"error"`
	// Attempts counts upstream tries.
	Attempts  int       `json:"attempts"`
	StartedAt time.Time `json:"started_at,omitzero"`
	// API is the API the client called: "chat.completions", or "responses"
	// for a Responses API call the proxy translated (the policy always
	// receives a chat completion, which is what the record holds).
	API string `json:"api"`

	// Engine is the base URL of the policy engine whose answer the call
	// got, when the proxy routed the call over a set of engines (--policy).
	Engine string `json:"engine,omitempty"`
	// PolicyVersion is the policy version in force when the answer was
	// produced (the proxy's pause gate sets it; 0 without one). A call an
	// abort pause cut and the proxy sent again carries its answer's version.
	PolicyVersion int64 `json:"policy_version"`
	// HeldMS is the time the call waited at the pause gate; it is part of
	// LatencyMS.
	HeldMS float64 `json:"held_ms,omitempty"`
	// UpstreamAttempts are the call's upstream tries, in order, where the
	// count alone does not say enough: every try of a call routed over a
	// set of engines (with its engine), and every try an abort pause cut
	// (the proxy sent the call again after the resume).
	UpstreamAttempts []UpstreamAttempt `json:"upstream_attempts,omitempty"`
}

// UpstreamAttempt is one upstream try of a call.
type UpstreamAttempt struct {
	// Attempt is its number among the call's Attempts (from 1).
	Attempt int `json:"attempt"`
	// Engine is the engine's OpenAI base URL, when the call went over a
	// set of engines.
	Engine string `json:"engine,omitempty"`
	// StatusCode is the upstream's HTTP status (0 when none came).
	StatusCode int `json:"status_code,omitempty"`
	// Error says why the try failed; empty when it was answered.
	Error string `json:"error,omitempty"`
	// Paused is set on a try an abort pause cut; PolicyVersion is the
	// version it ran under.
	Paused        bool  `json:"paused,omitempty"`
	PolicyVersion int64 `json:"policy_version,omitempty"`
}

// GraderContext is what a Grader works on. The grader service builds it; a
// test of a grader builds one with osmotest.NewGraderContext, or writes it
// as a literal, filling the exported fields.
type GraderContext struct {
	RolloutID string
	// Samples by sample id.
	Samples map[string]*Sample
	// Label is the dataset row's ground truth; nil when the row has none.
	Label *string
	// Metadata is the dataset row's metadata; nil when the row has none.
	Metadata map[string]any

	// What the grader decided, made on first use so that a literal works.
	mu      sync.Mutex
	rewards map[string]float64
	removed map[string]bool
}

// ErrNonFiniteReward is returned for NaN or infinite rewards.
var ErrNonFiniteReward = errors.New("reward must be a finite number")

// SetSampleReward sets the reward of sample id. The reward must be finite and
// the id must name a sample of this rollout.
func (gc *GraderContext) SetSampleReward(id string, reward float64) error {
	if math.IsNaN(reward) || math.IsInf(reward, 0) {
		return fmt.Errorf("sample %q: %w, got %v", id, ErrNonFiniteReward, reward)
	}
	if _, ok := gc.Samples[id]; !ok {
		return fmt.Errorf("sample %q: no such sample in rollout %q", id, gc.RolloutID)
	}
	gc.mu.Lock()
	defer gc.mu.Unlock()
	if gc.rewards == nil {
		gc.rewards = map[string]float64{}
	}
	gc.rewards[id] = reward
	return nil
}

// RemoveSample drops sample id from training; it then needs no reward.
func (gc *GraderContext) RemoveSample(id string) error {
	if _, ok := gc.Samples[id]; !ok {
		return fmt.Errorf("sample %q: no such sample in rollout %q", id, gc.RolloutID)
	}
	gc.mu.Lock()
	defer gc.mu.Unlock()
	if gc.removed == nil {
		gc.removed = map[string]bool{}
	}
	gc.removed[id] = true
	return nil
}

// Reward returns the reward set for id, if any.
func (gc *GraderContext) Reward(id string) (float64, bool) {
	gc.mu.Lock()
	defer gc.mu.Unlock()
	r, ok := gc.rewards[id]
	return r, ok
}

// Removed reports whether id was removed.
func (gc *GraderContext) Removed(id string) bool {
	gc.mu.Lock()
	defer gc.mu.Unlock()
	return gc.removed[id]
}

// Ungraded lists, sorted, the samples that have neither a reward nor the
// remove flag: after Grade returns, that list must be empty.
func (gc *GraderContext) Ungraded() []string {
	gc.mu.Lock()
	defer gc.mu.Unlock()
	var ids []string
	for id := range gc.Samples {
		if _, ok := gc.rewards[id]; !ok && !gc.removed[id] {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids
}

// RewardFunc mirrors @osmosis_reward: it scores a solution string against
// the ground truth. extraInfo carries the row's metadata.
type RewardFunc func(solution, groundTruth string, extraInfo map[string]any) (float64, error)

// RewardGrader turns a RewardFunc into a Grader: each sample's solution is its
// last assistant text and the ground truth is the label. Without a label it
// fails; the rollout service only grades rollouts that have one.
func RewardGrader(fn RewardFunc) Grader {
	return GraderFunc(func(ctx context.Context, gc *GraderContext) error {
		if gc.Label == nil {
			return errors.New("no label: this grader needs the row's ground truth")
		}
		for id, s := range gc.Samples {
			r, err := fn(LastAssistantText(s.Messages), *gc.Label, gc.Metadata)
			if err != nil {
				return fmt.Errorf("sample %q: %w", id, err)
			}
			if err := gc.SetSampleReward(id, r); err != nil {
				return err
			}
		}
		return nil
	})
}
