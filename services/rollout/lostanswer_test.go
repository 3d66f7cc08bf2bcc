package rollout

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/types/known/structpb"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/mockllm"
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
// it must still be sent, once (it once was taken as not to be sent, and
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
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	policy := httptest.NewServer(mock)
	defer policy.Close()
	var mu sync.Mutex
	got := map[string]int{}
	trainer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/completion" {
			time.Sleep(completionWait)
		}
		mu.Lock()
		got[r.URL.Path]++
		mu.Unlock()
	}))
	defer trainer.Close()

	var kv *lossyKV
	s, ctx := serveCalculator(t, gr, func(b jetstream.KeyValue) jetstream.KeyValue {
		kv = &lossyKV{KeyValue: b}
		return kv
	})

	msg, err := structpb.NewStruct(map[string]any{"role": "user", "content": "What is 6 * 7?"})
	if err != nil {
		t.Fatal(err)
	}
	label := structpb.NewStringValue("42")
	if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
		RolloutId: "lost-answer", InitialMessages: []*structpb.Struct{msg}, Label: label,
		ChatCompletionsUrl: policy.URL + "/v1", CompletionCallbackUrl: trainer.URL + "/completion",
		GraderCallbackUrl: new(trainer.URL + "/grader"),
	}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		mu.Lock()
		c, g := got["/completion"], got["/grader"]
		mu.Unlock()
		if c == 1 && g == 1 {
			break
		}
		if c > 1 || g > 1 || time.Now().After(deadline) {
			t.Fatalf("callbacks: %d completion, %d grader; want one each (answer lost: %v)", c, g, kv.lost.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !kv.lost.Load() {
		t.Fatal("no write was made to lose its answer: the test did not test anything")
	}
	// And nothing more comes.
	time.Sleep(500 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if got["/completion"] != 1 || got["/grader"] != 1 {
		t.Errorf("callbacks %v, want one each", got)
	}
}
