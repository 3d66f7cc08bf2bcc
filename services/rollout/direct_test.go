package rollout

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// createdKV notes the phase and owner each lifecycle was created in.
type createdKV struct {
	jetstream.KeyValue
	mu      sync.Mutex
	created map[string]lifecycle
}

func (kv *createdKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	var lc lifecycle
	if err := json.Unmarshal(value, &lc); err == nil {
		kv.mu.Lock()
		kv.created[lc.ID] = lc
		kv.mu.Unlock()
	}
	return kv.KeyValue.Create(ctx, key, value, opts...)
}

func (kv *createdKV) get(id string) lifecycle {
	kv.mu.Lock()
	defer kv.mu.Unlock()
	return kv.created[id]
}

// TestPrivateStateStartsAtOnce: a private state's replica starts a rollout
// it admits at once while a slot is free and nothing is queued: entered
// running, owned by it, never in a queue. With no slot free, a start is
// queued, in the process (the JetStream queue gets nothing), and runs when
// a slot frees; once the queue is empty again starts run at once again.
// Each is graded and called back.
func TestPrivateStateStartsAtOnce(t *testing.T) {
	mock, err := mockllm.New(mockllm.Options{Latency: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	policy := httptest.NewServer(mock)
	defer policy.Close()
	var mu sync.Mutex
	graded := map[string]bool{}
	trainer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b struct {
			RolloutID string `json:"rollout_id"`
		}
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/grader" && json.Unmarshal(body, &b) == nil {
			mu.Lock()
			graded[b.RolloutID] = true
			mu.Unlock()
		}
	}))
	defer trainer.Close()

	s, err := New(Config{AgentLoop: calculator.Loop{}, Grader: instantGrader{}, MaxConcurrent: 2,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	kv := &createdKV{KeyValue: s.sh.rollouts, created: map[string]lifecycle{}}
	s.sh.rollouts = kv
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
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
	start := func(id string) {
		t.Helper()
		if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
			RolloutId: id, InitialMessages: []*structpb.Struct{msg}, Label: structpb.NewStringValue("42"),
			ChatCompletionsUrl: policy.URL + "/v1", CompletionCallbackUrl: trainer.URL + "/completion",
			GraderCallbackUrl: new(trainer.URL + "/grader"),
		}); err != nil {
			t.Fatal(err)
		}
	}
	published := func() uint64 {
		t.Helper()
		info, err := s.sh.queue.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.LastSeq
	}
	waitGraded := func(ids ...string) {
		t.Helper()
		for ctx.Err() == nil {
			mu.Lock()
			n := 0
			for _, id := range ids {
				if graded[id] {
					n++
				}
			}
			mu.Unlock()
			if n == len(ids) {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("%v not all graded", ids)
	}

	base := published()
	start("first")
	// Every other slot is taken: the next start finds none free.
	var taken []func()
	for {
		release, ok := s.tryAcquire()
		if !ok {
			break
		}
		taken = append(taken, release)
	}
	start("second")
	if lc := kv.get("first"); lc.Phase != phaseRunning || lc.Owner != s.replica || lc.State != rolloutv1.State_STATE_RUNNING || lc.Started.IsZero() {
		t.Errorf("the first start was entered %+v, want running here", lc)
	}
	if lc := kv.get("second"); lc.Phase != phaseQueued || lc.Owner != "" {
		t.Errorf("the second start (no slot free) was entered %+v, want queued", lc)
	}
	if n := s.sh.local.depth(); n != 1 {
		t.Errorf("%d starts wait in the queue, want 1 (the second)", n)
	}
	if queued, err := s.sh.queued(ctx); err != nil || queued != 1 {
		t.Errorf("the queue's depth (osmo_rollouts_queued) reads %d, %v; want 1", queued, err)
	}
	for _, release := range taken {
		release()
	}
	waitGraded("first", "second")

	start("third")
	if lc := kv.get("third"); lc.Phase != phaseRunning || lc.Owner != s.replica {
		t.Errorf("a start once the queue is empty again was entered %+v, want running here", lc)
	}
	if n := published() - base; n != 0 {
		t.Errorf("%d starts went to the JetStream queue, want none", n)
	}
	waitGraded("third")
	for _, id := range []string{"first", "second", "third"} {
		if lc, _, err := s.sh.get(ctx, id); err != nil || lc.Phase != phaseFinished {
			t.Errorf("%s: %v, %v; want finished", id, lc, err)
		}
	}
	if rec := s.store.get("third"); rec != nil {
		t.Errorf("a finished rollout's record is still held: %s", rec.id)
	}
}
