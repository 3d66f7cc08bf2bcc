package osmo

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
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
// sees it.
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
	// LLMCalls are the sample's calls through the LLM proxy, in order.
	LLMCalls []LLMCall
	// AgentReward is the reward the workflow proposed, if any.
	AgentReward *float64
	// FinishReason is why the agent stopped.
	FinishReason string
}

// RolloutSample is the Osmosis name of a Sample.
type RolloutSample = Sample

// SampleMetrics are the counters of a sample.
type SampleMetrics struct {
	TotalLatencyMS   float64
	LLMLatencyMS     float64
	ToolLatencyMS    float64
	NumLLMCalls      int
	NumToolCalls     int
	PromptTokens     int
	ResponseTokens   int
	MaxContextTokens int
}

// LLMCall is one recorded chat completion of a sample.
type LLMCall struct {
	ID    string
	Model string
	// RequestMessages are the messages of the request. Those a call
	// repeats from the previous call's are the same Message values as
	// there, and those the sample's Messages hold too (the same JSON) the
	// same values as in Messages: read them, do not change them.
	RequestMessages []Message
	ResponseMessage Message
	FinishReason    string
	Usage           Usage
	// Exact tokens and per-token log probabilities, when the policy
	// returned them.
	PromptTokenIDs     []int32
	CompletionTokenIDs []int32
	Logprobs           []float64
	LatencyMS          float64
	StatusCode         int
	Error              string
}

// GraderContext is what a Grader works on. The grader service builds it
// (host.NewGraderContext); a test of a grader may also write one as a
// literal, filling the exported fields.
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
