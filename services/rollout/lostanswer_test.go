package rollout

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
)

// lossyKV makes the first lifecycle write that lets the final stage be
// sent and then tells the writer it timed out: an answer lost on the way,
// as an overloaded NATS server loses it.
type lossyKV struct {
	jetstream.KeyValue
	lost atomic.Bool
}

func (kv *lossyKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	rev, err := kv.KeyValue.Update(ctx, key, value, last)
	if err != nil || kv.lost.Load() {
		return rev, err
	}
	var lc lifecycle
	if json.Unmarshal(value, &lc) == nil && lc.Phase == phaseFinal && lc.Final != nil && lc.Final.Sending && !lc.Final.done() {
		kv.lost.Store(true)
		return 0, context.DeadlineExceeded
	}
	return rev, err
}

// slowGrader grades every sample 1, after a while (so the completion
// callback is delivered, and the first stage done, before the final stage
// is owed).
type slowGrader struct{}

func (slowGrader) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	time.Sleep(300 * time.Millisecond)
	return instantGrader{}.Grade(ctx, req)
}

// TestFinalStageOwedWithALostAnswer: the write that owes the final stage
// (the first one done, so it is to be sent at once) is made, but its answer
// is lost and the write is tried again. The retry finds the stage written:
// it must still be sent, once, with its body (it once was taken as not to be sent, and
// the grader callback never went out). That write is the final stage's
// own when the grading ends after the first stage's mark, and the mark's
// when it ends before.
func TestFinalStageOwedWithALostAnswer(t *testing.T) {
	for name, c := range map[string]struct {
		grader         Grader
		completionWait time.Duration
	}{
		"graded after the mark":  {slowGrader{}, 0},
		"graded before the mark": {instantGrader{}, 50 * time.Millisecond},
	} {
		t.Run(name, func(t *testing.T) { finalStageOwedWithALostAnswer(t, c.grader, c.completionWait) })
	}
}

func finalStageOwedWithALostAnswer(t *testing.T, gr Grader, completionWait time.Duration) {
	var kv *lossyKV
	tally, s := startCalculator(t, 1, "lost-answer", func() time.Duration { return completionWait }, gr, func(b jetstream.KeyValue) jetstream.KeyValue {
		kv = &lossyKV{KeyValue: b}
		return kv
	})
	tally.await(t, 1, 20*time.Second, func() string { return fmt.Sprintf("answer lost: %v", kv.lost.Load()) })
	if !kv.lost.Load() {
		t.Fatal("no write was made to lose its answer: the test did not test anything")
	}
	// And nothing more comes.
	time.Sleep(500 * time.Millisecond)
	if c, g := tally.counts(); c != 1 || g != 1 {
		t.Errorf("callbacks: %d completion, %d grader; want one each", c, g)
	}
	// The retry read the stage back from a private state, which stores
	// no payload: the grader callback went out whole all the same
	// (tally.await checks its body), and its payload is let go of.
	awaitFinished(t, s, "lost-answer", 1)
	if held := s.sh.bodies.len(); held != 0 {
		t.Errorf("payloads of %d finished rollouts still held", held)
	}
}
