package rollout

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// unmarkableKV stands for a NATS node lost under a replica marking its
// first callback delivered: every lifecycle write that marks the first
// stage done times out, unwritten, while refuse says so. finalOwed is
// closed once a write owes the final stage.
type unmarkableKV struct {
	jetstream.KeyValue
	refuse    func() bool
	refused   atomic.Int64
	finalOwed chan struct{}
	owedOnce  sync.Once
}

func (kv *unmarkableKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	var lc lifecycle
	if json.Unmarshal(value, &lc) == nil && lc.Ran.done() && kv.refuse() {
		kv.refused.Add(1)
		return 0, context.DeadlineExceeded
	}
	rev, err := kv.KeyValue.Update(ctx, key, value, last)
	if err == nil && lc.Final != nil {
		kv.owedOnce.Do(func() { close(kv.finalOwed) })
	}
	return rev, err
}

// TestFinalStageWaitsForTheMark: the trainer takes a rollout's completion
// callback, and every write of its mark times out until the replica gives
// the mark up (a NATS node lost). The mark would have started the final
// stage, owed already; but as the mark was not written, neither was that.
// The grader callback must not go out then: no lifecycle would record its
// delivery, and the replica that concludes the rollout again (its work
// was not let go of) would send it once more, after the completion that
// comes again. Every grader callback must find the first stage marked
// done in the shared state, and the rollout ends with one.
func TestFinalStageWaitsForTheMark(t *testing.T) {
	// A state in files: not private, so the work held by the replica that
	// gave the mark up comes back to be concluded again.
	st, err := natsstore.Open(t.Context(), natsstore.Config{Dir: t.TempDir(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	s, err := New(Config{AgentLoop: calculator.Loop{}, Grader: instantGrader{}, LostAfter: time.Second, State: st,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var completions, graders atomic.Int64
	kv := &unmarkableKV{KeyValue: s.sh.rollouts, finalOwed: make(chan struct{}),
		// Until the completion is posted again, by whoever concludes
		// the rollout once the mark was given up.
		refuse: func() bool { return completions.Load() < 2 }}
	s.sh.rollouts = kv

	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	policy := httptest.NewServer(mock)
	defer policy.Close()
	var (
		mu       sync.Mutex
		unmarked []string // the first stage as stored when a grader callback came
	)
	trainer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/completion":
			// Answered once the final stage is owed (graded, it is owed
			// after Config.FinalWait): the mark is the write that starts it.
			select {
			case <-kv.finalOwed:
			case <-time.After(10 * time.Second):
			}
			completions.Add(1)
		case "/grader":
			graders.Add(1)
			var lc lifecycle
			e, err := kv.KeyValue.Get(r.Context(), natsstore.Key("lost-mark"))
			if err == nil {
				err = json.Unmarshal(e.Value(), &lc)
			}
			if err != nil || !lc.Ran.done() {
				var done []bool
				if lc.Ran != nil {
					done = lc.Ran.Done
				}
				mu.Lock()
				unmarked = append(unmarked, fmt.Sprintf("phase %q, first stage done %v (%v)", lc.Phase, done, err))
				mu.Unlock()
			}
		}
	}))
	defer trainer.Close()

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
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
	if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
		RolloutId: "lost-mark", InitialMessages: []*structpb.Struct{msg}, Label: structpb.NewStringValue("42"),
		ChatCompletionsUrl: policy.URL + "/v1", CompletionCallbackUrl: trainer.URL + "/completion",
		GraderCallbackUrl: new(trainer.URL + "/grader"),
	}); err != nil {
		t.Fatal(err)
	}

	for {
		var lc lifecycle
		e, err := kv.KeyValue.Get(ctx, natsstore.Key("lost-mark"))
		if err == nil && json.Unmarshal(e.Value(), &lc) == nil && lc.Phase == phaseFinished {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the rollout did not finish: phase %q; callbacks: %d completion, %d grader", lc.Phase, completions.Load(), graders.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// And nothing more comes.
	time.Sleep(500 * time.Millisecond)
	if kv.refused.Load() == 0 {
		t.Fatal("no mark was refused: the test did not test anything")
	}
	mu.Lock()
	defer mu.Unlock()
	for _, u := range unmarked {
		t.Errorf("a grader callback went out while the first stage was not marked done: %s", u)
	}
	// The completion comes again: its mark was given up on.
	if c, g := completions.Load(), graders.Load(); c != 2 || g != 1 {
		t.Errorf("callbacks: %d completion, %d grader; want 2 and 1", c, g)
	}
}
