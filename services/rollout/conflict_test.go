package rollout

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
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
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// countingKV counts the lifecycle writes that lost a compare-and-set.
type countingKV struct {
	jetstream.KeyValue
	writes, lost atomic.Int64
}

func (kv *countingKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	kv.writes.Add(1)
	rev, err := kv.KeyValue.Update(ctx, key, value, last)
	if err != nil && isWrongSequence(err) {
		kv.lost.Add(1)
	}
	return rev, err
}

// quickGrader grades every sample 1 within a couple of milliseconds.
type quickGrader struct{}

func (quickGrader) Grade(_ context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
	resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "quick"}
	for _, sm := range req.GetSamples() {
		r := 1.0
		resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: sm.GetId(), Reward: &r})
	}
	return resp, nil
}

// TestConcludingWritesDoNotConflict: while a rollout's first callback is
// delivered its grading goes on, and both then write the lifecycle (the
// callback's mark, the final stage owed). Made together they would race,
// and the loser would read the lifecycle and write it again; the replica
// makes them one after the other.
func TestConcludingWritesDoNotConflict(t *testing.T) {
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	policy := httptest.NewServer(mock)
	defer policy.Close()
	const n = 100
	var mu sync.Mutex
	got := map[string]int{}
	trainer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		// The trainer answers in about the time the grading takes: the
		// two writes that follow fall together.
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
		mu.Lock()
		got[r.URL.Path]++
		mu.Unlock()
	}))
	defer trainer.Close()

	s, err := New(Config{AgentLoop: calculator.Loop{}, Grader: quickGrader{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	kv := &countingKV{KeyValue: s.sh.rollouts}
	s.sh.rollouts = kv
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx) }()
	defer func() {
		cancel()
		<-served
		_ = s.Close()
	}()

	msg, err := structpb.NewStruct(map[string]any{"role": "user", "content": "What is 6 * 7?"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
			RolloutId: fmt.Sprintf("conflict-%d", i), InitialMessages: []*structpb.Struct{msg}, Label: structpb.NewStringValue("42"),
			ChatCompletionsUrl: policy.URL + "/v1", CompletionCallbackUrl: trainer.URL + "/completion",
			GraderCallbackUrl: new(trainer.URL + "/grader"),
		}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		c, g := got["/completion"], got["/grader"]
		mu.Unlock()
		if c == n && g == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("callbacks: %d completion, %d grader; want %d each", c, g, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if lost := kv.lost.Load(); lost > 0 {
		t.Errorf("%d of %d lifecycle writes of %d rollouts lost a compare-and-set to another write of the same replica", lost, kv.writes.Load(), n)
	}
}
