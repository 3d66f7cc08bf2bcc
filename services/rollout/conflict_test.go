package rollout

import (
	"context"
	"encoding/json"
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
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// countingKV counts the lifecycle writes made, those that lost a
// compare-and-set, those that owed the final stage (the first stored with
// it), and those that carried a final callback's body.
type countingKV struct {
	jetstream.KeyValue
	writes, lost, finalOwed, finalBodies atomic.Int64
	// owed: the keys stored with a final stage; marked: those stored with
	// their first stage done.
	owed, marked sync.Map
}

func (kv *countingKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	var lc lifecycle
	final := json.Unmarshal(value, &lc) == nil && lc.Final != nil
	if final {
		for _, c := range lc.Final.Callbacks {
			if len(c.Payload) > 0 {
				kv.finalBodies.Add(1)
				break
			}
		}
	}
	rev, err := kv.KeyValue.Update(ctx, key, value, last)
	switch {
	case err == nil:
		// Writes made, not tried: a try that timed out on a busy machine
		// and was made again is one write.
		kv.writes.Add(1)
	case isWrongSequence(err):
		kv.lost.Add(1)
	}
	if err == nil && final {
		if _, seen := kv.owed.LoadOrStore(key, true); !seen {
			kv.finalOwed.Add(1)
		}
	}
	if err == nil && lc.Ran.done() {
		kv.marked.Store(key, true)
	}
	return rev, err
}

// afterMarkGrader grades every sample 1 once its rollout's first stage is
// marked done in kv: the grading ends after the mark, however slow the
// machine.
type afterMarkGrader struct{ kv *countingKV }

func (g afterMarkGrader) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	key := natsstore.Key(req.GetRolloutId())
	for {
		if _, ok := g.kv.marked.Load(key); ok {
			return instantGrader{}.Grade(ctx, req)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// quickGrader grades every sample 1 within a couple of milliseconds;
// instantGrader at once.
type (
	quickGrader   struct{}
	instantGrader struct{}
)

func (quickGrader) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
	return instantGrader{}.Grade(ctx, req)
}

func (instantGrader) Grade(_ context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "instant"}
	for _, sm := range samplesOf(req) {
		r := 1.0
		resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: sm.GetId(), Reward: &r})
	}
	return resp, nil
}

// newCalculatorService is a Service of the calculator loop at the default
// settings (a private state), logging nothing, not serving, closed when
// the test ends.
func newCalculatorService(t *testing.T) *Service {
	t.Helper()
	s, err := New(Config{AgentLoop: calculator.Loop{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// serveCalculator serves the calculator loop graded by gr, its lifecycles
// in the bucket wrap makes of the real one, until the test ends; ctx is
// the test's, 60 s long.
func serveCalculator(t *testing.T, gr Grader, wrap func(jetstream.KeyValue) jetstream.KeyValue) (*Service, context.Context) {
	t.Helper()
	// A final stage is owed with the first stage's mark however long the
	// mark takes on a busy machine: the tests here count those writes.
	s, err := New(Config{AgentLoop: calculator.Loop{}, Grader: gr, FinalWait: time.Minute, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	s.sh.rollouts = wrap(s.sh.rollouts)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-served
		_ = s.Close()
	})
	return s, ctx
}

// concludeMany runs n G2 rollouts graded by gr to their grader callbacks,
// the trainer answering each completion callback after trainerWait(), and
// returns the lifecycle writes made, and the service once every lifecycle
// is finished.
func concludeMany(t *testing.T, n int, trainerWait func() time.Duration, grader func(*countingKV) Grader) (*countingKV, *Service) {
	t.Helper()
	kv := &countingKV{}
	tally, s := startCalculator(t, n, "conclude", trainerWait, grader(kv), func(b jetstream.KeyValue) jetstream.KeyValue {
		kv.KeyValue = b
		return kv
	})
	tally.await(t, n, 30*time.Second, nil)
	awaitFinished(t, s, "conclude", n)
	return kv, s
}

// awaitFinished waits until the lifecycles of rollouts prefix-0 ... are
// finished: their final callback's mark, written once it is answered.
// They are read as stored (not through shared.get, which would let go of
// their held payloads).
func awaitFinished(t *testing.T, s *Service, prefix string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; i < n; {
		var lc lifecycle
		e, err := s.sh.rollouts.Get(t.Context(), natsstore.Key(fmt.Sprintf("%s-%d", prefix, i)))
		if err == nil && json.Unmarshal(e.Value(), &lc) == nil && lc.Phase == phaseFinished {
			i++
			continue
		}
		if time.Now().After(deadline) {
			t.Fatalf("rollout %s-%d: lifecycle not finished (phase %q, %v)", prefix, i, lc.Phase, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// trainerTally counts the callbacks a test's trainer received, by path,
// and says what was wrong with any grader callback body that does not
// carry its rollout's samples.
type trainerTally struct {
	mu  sync.Mutex
	got map[string]int
	bad []string
}

// checkGraderBody notes what is wrong with body, a grader callback's: it
// names a rollout and carries each of its samples with their messages.
func (c *trainerTally) checkGraderBody(body []byte) {
	var b struct {
		RolloutID string `json:"rollout_id"`
		Samples   map[string]struct {
			Messages []json.RawMessage `json:"messages"`
		} `json:"samples"`
	}
	wrong := ""
	switch err := json.Unmarshal(body, &b); {
	case err != nil:
		wrong = err.Error()
	case b.RolloutID == "" || len(b.Samples) == 0:
		wrong = "no rollout id or no samples"
	default:
		for id, sm := range b.Samples {
			if len(sm.Messages) == 0 {
				wrong = "sample " + id + " without messages"
			}
		}
	}
	if wrong != "" {
		c.mu.Lock()
		c.bad = append(c.bad, fmt.Sprintf("%s: %.200q", wrong, body))
		c.mu.Unlock()
	}
}

func (c *trainerTally) counts() (completion, grader int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.got["/completion"], c.got["/grader"]
}

// await waits until the trainer has n callbacks of each kind, and fails
// the test when it gets more or they take longer than within; note, when
// not nil, adds to the failure.
func (c *trainerTally) await(t *testing.T, n int, within time.Duration, note func() string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		comp, grade := c.counts()
		c.mu.Lock()
		bad := c.bad
		c.mu.Unlock()
		if len(bad) > 0 {
			t.Fatalf("%d grader callback bodies without their samples; the first: %s", len(bad), bad[0])
		}
		if comp == n && grade == n {
			return
		}
		if comp > n || grade > n || time.Now().After(deadline) {
			extra := ""
			if note != nil {
				extra = " (" + note() + ")"
			}
			t.Fatalf("callbacks: %d completion, %d grader; want %d each%s", comp, grade, n, extra)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startCalculator starts n G2 rollouts (ids prefix-0, prefix-1, ...) of the
// calculator loop graded by gr, its lifecycles in the bucket wrap makes of
// the real one, against a policy double and a trainer that answers each
// completion callback after trainerWait(); both serve until the test ends.
func startCalculator(t *testing.T, n int, prefix string, trainerWait func() time.Duration, gr Grader, wrap func(jetstream.KeyValue) jetstream.KeyValue) (*trainerTally, *Service) {
	t.Helper()
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	policy := httptest.NewServer(mock)
	t.Cleanup(policy.Close)
	tally := &trainerTally{got: map[string]int{}}
	trainer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/completion":
			time.Sleep(trainerWait())
		case "/grader":
			tally.checkGraderBody(body)
		}
		tally.mu.Lock()
		tally.got[r.URL.Path]++
		tally.mu.Unlock()
	}))
	t.Cleanup(trainer.Close)

	// Served after the servers above start, so stopped before they close.
	s, ctx := serveCalculator(t, gr, wrap)
	msg, err := structpb.NewStruct(map[string]any{"role": "user", "content": "What is 6 * 7?"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
			RolloutId: fmt.Sprintf("%s-%d", prefix, i), InitialMessages: []*structpb.Struct{msg}, Label: structpb.NewStringValue("42"),
			ChatCompletionsUrl: policy.URL + "/v1", CompletionCallbackUrl: trainer.URL + "/completion",
			GraderCallbackUrl: new(trainer.URL + "/grader"),
		}); err != nil {
			t.Fatal(err)
		}
	}
	return tally, s
}

// TestConcludingWritesDoNotConflict: while a rollout's first callback is
// delivered its grading goes on, and both then write the lifecycle (the
// callback's mark, the final stage owed). Made together they race, and the
// loser reads the lifecycle and writes it again (44-46 of ~445 writes for
// 100 rollouts did); the final stage is owed once the first stage's
// callbacks were tried and marked, when that comes within Config.FinalWait.
func TestConcludingWritesDoNotConflict(t *testing.T) {
	const n = 100
	// The trainer answers in about the time the grading takes: the two
	// writes that follow fall together.
	kv, _ := concludeMany(t, n, func() time.Duration { return time.Duration(rand.IntN(2000)) * time.Microsecond }, func(*countingKV) Grader { return quickGrader{} })
	if lost := kv.lost.Load(); lost > 0 {
		t.Errorf("%d of %d lifecycle writes of %d rollouts lost a compare-and-set to another write of the same replica", lost, kv.writes.Load(), n)
	}
}

// TestFinalBodiesWrittenOnce: a rollout graded before its trainer answers
// the completion callback owes its final stage with the mark of the first
// stage, once that answer is in: the final stage is written once, in the
// same write as the mark, the write the final stage's own would have
// followed. Each rollout's lifecycle is then updated twice: it owes its
// first stage, that stage is marked with the final stage owed (then the
// final stage's mark finishes it; its creation, which starts it at once
// in a private state, and its finish are writes of another kind).
func TestFinalBodiesWrittenOnce(t *testing.T) {
	const n = 20
	kv, s := concludeMany(t, n, func() time.Duration { return 20 * time.Millisecond }, func(*countingKV) Grader { return instantGrader{} })
	if got := kv.finalOwed.Load(); got != n {
		t.Errorf("%d lifecycle writes owed the final stage for %d rollouts, want %d", got, n, n)
	}
	if got := kv.writes.Load(); got != 2*n {
		t.Errorf("%d lifecycle updates for %d rollouts, want %d: the final stage was not owed with the first stage's mark", got, n, 2*n)
	}
	heldBodies(t, s, kv, n)
}

// heldBodies checks where the final callbacks' bodies (the grader
// callback carries every sample) went, the trainer having had them whole:
// a private state (the embedded server in memory, as here) stores none,
// and holds none once the rollouts are finished; any other stores each
// with the write that owes its stage.
func heldBodies(t *testing.T, s *Service, kv *countingKV, n int) {
	t.Helper()
	want := int64(n)
	if s.sh.store.Private() {
		want = 0
	}
	if got := kv.finalBodies.Load(); got != want {
		t.Errorf("%d lifecycle writes carried the final callbacks' bodies for %d rollouts, want %d (private state: %v)", got, n, want, s.sh.store.Private())
	}
	if held := s.sh.bodies.len(); held != 0 {
		t.Errorf("payloads of %d finished rollouts still held", held)
	}
}

// TestFinalOwedAfterASlowGrading: a grading that ends after the first
// stage's mark was written has its final stage owed in a write of its
// own; nothing waits for a mark to take it.
func TestFinalOwedAfterASlowGrading(t *testing.T) {
	const n = 10
	kv, s := concludeMany(t, n, func() time.Duration { return 0 }, func(kv *countingKV) Grader { return afterMarkGrader{kv} })
	if got := kv.finalOwed.Load(); got != n {
		t.Errorf("%d lifecycle writes owed the final stage for %d rollouts, want %d", got, n, n)
	}
	if got := kv.writes.Load(); got != 3*n {
		t.Errorf("%d lifecycle updates for %d rollouts, want %d (first stage, its mark, final stage)", got, n, 3*n)
	}
	heldBodies(t, s, kv, n)
}

// samplesOf is the samples of a grade request, read as the API's
// messages, whichever form it carries them in.
func samplesOf(req *graderv1.GradeRequest) []*rolloutv1.RolloutSample {
	if len(req.GetSamplesJson()) == 0 {
		return req.GetSamples()
	}
	var r graderv1.GradeRequest
	b := append(append([]byte(`{"samples":`), req.GetSamplesJson()...), '}')
	if err := sample.FromJSON(b, &r); err != nil {
		panic(err)
	}
	return r.GetSamples()
}
