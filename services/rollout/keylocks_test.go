package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
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

// keyLocks serialize holders of one key, leave other keys alone, give up
// on a waiter whose context ends, and keep nothing once no one holds or
// waits.
func TestKeyLocks(t *testing.T) {
	var l keyLocks
	ctx := t.Context()
	var inside, most atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 200 {
				if !l.lock(ctx, "a") {
					t.Error("lock refused with a live context")
					return
				}
				n := inside.Add(1)
				if n > most.Load() {
					most.Store(n)
				}
				inside.Add(-1)
				l.unlock("a")
			}
		})
	}
	wg.Wait()
	if most.Load() != 1 {
		t.Errorf("%d holders of one key at once", most.Load())
	}

	if !l.lock(ctx, "a") {
		t.Fatal("lock refused")
	}
	if !l.lock(ctx, "b") {
		t.Fatal("another key waited for a")
	}
	l.unlock("b")
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if l.lock(short, "a") {
		t.Fatal("a second holder of a held key")
	}
	l.unlock("a")
	l.mu.Lock()
	left := len(l.m)
	l.mu.Unlock()
	if left != 0 {
		t.Errorf("%d keys kept with no holder", left)
	}
}

// conflictKV counts lifecycle writes refused for a revision that is not
// the latest.
type conflictKV struct {
	jetstream.KeyValue
	conflicts atomic.Int32
	updates   atomic.Int32
}

func (kv *conflictKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	rev, err := kv.KeyValue.Update(ctx, key, value, last)
	kv.updates.Add(1)
	if err != nil && isWrongSequence(err) {
		kv.conflicts.Add(1)
	}
	return rev, err
}

// quickGrader grades every sample 1 at once, so that a rollout's final
// stage is owed while its completion callback is being delivered.
type quickGrader struct{}

func (quickGrader) Grade(_ context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "quick"}
	for _, sm := range req.GetSamples() {
		r := 1.0
		resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: sm.GetId(), Reward: &r})
	}
	return resp, nil
}

// TestOneReplicaWritesALifecycleInTurn: a rollout's conclusion (owing the
// final stage) and the sender of its completion callback (marking it done)
// write its lifecycle at about the same time. They take turns: no write of
// this replica is refused for a revision another of its own writes
// replaced (each refusal cost a read and a second write of the whole
// lifecycle), and every rollout gets its two callbacks once.
func TestOneReplicaWritesALifecycleInTurn(t *testing.T) {
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	policy := httptest.NewServer(mock)
	defer policy.Close()
	var mu sync.Mutex
	got := map[string]int{}
	trainer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			RolloutID string `json:"rollout_id"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		got[r.URL.Path+" "+body.RolloutID]++
		mu.Unlock()
	}))
	defer trainer.Close()

	s, err := New(Config{AgentLoop: calculator.Loop{}, Grader: quickGrader{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	kv := &conflictKV{KeyValue: s.sh.rollouts}
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
	const n = 40
	for i := range n {
		if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
			RolloutId: "turns-" + strconv.Itoa(i), InitialMessages: []*structpb.Struct{msg}, Label: structpb.NewStringValue("42"),
			ChatCompletionsUrl: policy.URL + "/v1", CompletionCallbackUrl: trainer.URL + "/completion",
			GraderCallbackUrl: new(trainer.URL + "/grader"),
		}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(45 * time.Second)
	for {
		mu.Lock()
		done := len(got) == 2*n
		mu.Unlock()
		if done && s.completed.Load() == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d callbacks, %d of %d rollouts finished", len(got), 2*n, s.completed.Load(), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	mu.Lock()
	for k, c := range got {
		if c != 1 {
			t.Errorf("%s: %d callbacks, want 1", k, c)
		}
	}
	mu.Unlock()
	if c := kv.conflicts.Load(); c != 0 {
		t.Errorf("%d of %d lifecycle writes refused for a revision this replica replaced", c, kv.updates.Load())
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatal("ran out of time")
	}
}
