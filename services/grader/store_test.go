package grader_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/services/grader"
)

// halfAndFail rewards every sample 0.5, and fails rollout "fails".
func halfAndFail() *counter {
	return newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		if gc.RolloutID == "fails" {
			return errBoom
		}
		for id := range gc.Samples {
			if err := gc.SetSampleReward(id, 0.5); err != nil {
				return err
			}
		}
		return nil
	})
}

// A resent sample that reaches another replica (the first one lost, or the
// stream rebalanced) is answered from the grading the first one stored,
// failed gradings included, without running the grader.
func TestAnotherReplicaAnswersFromTheStore(t *testing.T) {
	state := openState(t, "")
	ca, cb := halfAndFail(), halfAndFail()
	a := stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": ca}, Default: "g", State: state}))
	b := stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": cb}, Default: "g", State: state}))
	ctx := testContext(t)

	wantGrade(t, "replica A", grade(t, a, gradeReq(t, "r1", "x", "a", "b")), 1, 0.5, false)
	failed, err := a.Grade(ctx, gradeReq(t, "fails", "x", "a"))
	if err != nil || failed.GetError() == "" {
		t.Fatalf("failing rollout at A: %v %v", failed, err)
	}

	resp := grade(t, b, gradeReq(t, "r1", "x", "a", "b"))
	wantGrade(t, "s0 at replica B", resp, 0, 0.5, true)
	wantGrade(t, "s1 at replica B", resp, 1, 0.5, true)
	if resp, err := b.Grade(ctx, gradeReq(t, "fails", "x", "a")); err != nil || resp.GetError() != failed.GetError() {
		t.Fatalf("failing rollout at B: %v %v, want error %q", resp, err, failed.GetError())
	}
	if cb.count() != 0 {
		t.Fatalf("replica B ran its grader %d times, want 0", cb.count())
	}
	// What B grades, A answers.
	wantGrade(t, "new sample at B", grade(t, b, gradeReq(t, "r1", "x", "a", "b", "c")), 2, 0.5, false)
	wantGrade(t, "B's sample at A", grade(t, a, gradeReq(t, "r1", "x", "a", "b", "c")), 2, 0.5, true)
	if ca.count() != 2 || cb.count() != 1 || cb.graded("r1/s2") != 1 || cb.graded("r1/s0") != 0 {
		t.Fatalf("A ran %d times, B %d times (s0 %d, s2 %d); want 2, 1 (0, 1)", ca.count(), cb.count(), cb.graded("r1/s0"), cb.graded("r1/s2"))
	}
}

// With the embedded server on disk, stopping everything (service and NATS)
// and starting again keeps the gradings.
func TestGradingsSurviveARestart(t *testing.T) {
	dir := t.TempDir()
	c1 := halfAndFail()
	cfg := grader.Config{Graders: map[string]osmo.Grader{"g": c1}, Default: "g", State: openState(t, dir)}
	ts := startServer(t, "127.0.0.1:0", cfg)
	ctx := testContext(t)
	client := stub(t, ts)
	first := grade(t, client, gradeReq(t, "r1", "x", "a"))
	failed, err := client.Grade(ctx, gradeReq(t, "fails", "x", "a"))
	if err != nil || failed.GetError() == "" {
		t.Fatalf("%v %v", failed, err)
	}
	ts.kill(t)
	if err := cfg.State.Close(); err != nil {
		t.Fatal(err)
	}

	c2 := newCounter(nil)
	cfg.Graders, cfg.State = map[string]osmo.Grader{"g": c2}, openState(t, dir)
	client = stub(t, startServer(t, "127.0.0.1:0", cfg))
	resp := grade(t, client, gradeReq(t, "r1", "x", "a"))
	wantGrade(t, "after restart", resp, 0, first.GetGrades()[0].GetReward(), true)
	if resp.GetGrader() != "g" {
		t.Fatalf("grader %q after restart", resp.GetGrader())
	}
	if resp, err := client.Grade(ctx, gradeReq(t, "fails", "x", "a")); err != nil || resp.GetError() != failed.GetError() {
		t.Fatalf("failed grading after restart: %v %v", resp, err)
	}
	if c2.count() != 0 {
		t.Fatalf("the restarted service graded %d times, want 0", c2.count())
	}
	// New gradings still work.
	wantGrade(t, "new rollout", grade(t, client, gradeReq(t, "r2", "x", "a")), 0, 1, false)
}

// Two replicas grading different samples of one rollout at once both keep
// their gradings: each write is a compare-and-set on the rollout's key, so
// the later one is laid over the earlier instead of replacing it.
func TestConcurrentGradingsOfOneRolloutOnTwoReplicas(t *testing.T) {
	const rollouts = 20
	state := openState(t, "")
	// Each rollout's two gradings wait for each other, so they finish, and
	// write, at the same time.
	var (
		mu      sync.Mutex
		arrived = map[string]int{}
		both    = map[string]chan struct{}{}
	)
	meet := func(rid string) <-chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		if both[rid] == nil {
			both[rid] = make(chan struct{})
		}
		if arrived[rid]++; arrived[rid] == 2 {
			close(both[rid])
		}
		return both[rid]
	}
	replica := func() (*counter, graderv1.GraderServiceClient) {
		c := newCounter(func(ctx context.Context, gc *osmo.GraderContext) error {
			select {
			case <-meet(gc.RolloutID):
			case <-ctx.Done():
				return ctx.Err()
			}
			for id := range gc.Samples {
				if err := gc.SetSampleReward(id, 1); err != nil {
					return err
				}
			}
			return nil
		})
		return c, stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", State: state}))
	}
	_, a := replica()
	_, b := replica()

	ctx := testContext(t)
	var wg sync.WaitGroup
	for i := range rollouts {
		rid := fmt.Sprintf("r%d", i)
		for j, client := range []graderv1.GraderServiceClient{a, b} {
			req := gradeReq(t, rid, "x", "a", "b")
			req.Samples = req.Samples[j : j+1] // A grades s0, B grades s1
			wg.Go(func() {
				if resp, err := client.Grade(ctx, req); err != nil || resp.GetError() != "" || len(resp.GetGrades()) != 1 {
					t.Errorf("%s at replica %d: %v %v", rid, j, resp, err)
				}
			})
		}
	}
	wg.Wait()
	if t.Failed() {
		return
	}

	kv := gradingsBucket(t, state)
	for i := range rollouts {
		rid := fmt.Sprintf("r%d", i)
		held := map[string]bool{}
		for _, g := range storedGradings(t, kv, rid) {
			for _, r := range g.Samples {
				held[r.ID] = true
			}
		}
		if !held["s0"] || !held["s1"] {
			t.Errorf("%s: the bucket holds samples %v, want s0 and s1", rid, held)
		}
	}
	// And so a third replica answers both samples of every rollout.
	c := newCounter(nil)
	third := stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", State: state}))
	for i := range rollouts {
		rid := fmt.Sprintf("r%d", i)
		resp := grade(t, third, gradeReq(t, rid, "x", "a", "b"))
		for j := range 2 {
			if !resp.GetGrades()[j].GetCached() {
				t.Errorf("%s: sample s%d graded again by a third replica", rid, j)
			}
		}
	}
	if c.count() != 0 {
		t.Errorf("a third replica graded %d times, want 0", c.count())
	}
}

// A grading older than ResultTTL is graded again. The bucket's TTL is
// ResultTTL, so an expired rollout's key is dropped from it too.
func TestBucketExpiresGradings(t *testing.T) {
	const ttl = 200 * time.Millisecond
	state := openState(t, "")
	c := newCounter(nil)
	client := stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", State: state, ResultTTL: ttl}))
	kv := gradingsBucket(t, state)
	st, err := kv.Status(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if st.TTL() != ttl {
		t.Fatalf("bucket TTL %s, want %s", st.TTL(), ttl)
	}
	wantGrade(t, "first", grade(t, client, gradeReq(t, "r1", "x", "a")), 0, 1, false)
	if len(storedGradings(t, kv, "r1")) != 1 {
		t.Fatal("the grading is not in the bucket")
	}
	waitFor(t, "the bucket to drop r1", func() bool {
		_, err := kv.Get(testContext(t), natsstore.Key("r1"))
		return errors.Is(err, jetstream.ErrKeyNotFound)
	})
	wantGrade(t, "after the TTL", grade(t, client, gradeReq(t, "r1", "x", "a")), 0, 1, false)
	if c.count() != 2 {
		t.Fatalf("grader ran %d times, want 2", c.count())
	}
}

// When NATS cannot be reached, a request is refused with Unavailable (the
// client resends) rather than graded without knowing whether it was; a
// grading that finished but cannot be stored is still answered.
func TestStoreUnreachable(t *testing.T) {
	state := openState(t, "")
	var sink logSink
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		// NATS goes away while the grader runs: after the lookup, before
		// the write.
		if err := state.Close(); err != nil {
			return err
		}
		return gc.SetSampleReward("s0", 0.75)
	})
	client := stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", State: state, Logger: sink.logger()}))
	wantGrade(t, "graded, not stored", grade(t, client, gradeReq(t, "r1", "x", "a")), 0, 0.75, false)
	stored := false
	for _, r := range sink.records() {
		stored = stored || r.msg == "graded"
		if r.msg == "grading not stored; a resend may grade these samples again" && !strings.Contains(fmt.Sprint(r.attrs["error"]), "kv create") {
			t.Errorf("error %v does not name the call that failed", r.attrs["error"])
		}
	}
	if stored {
		t.Error(`a grading that was not stored was logged "graded"`)
	}
	if !logged(sink.records(), "grading not stored; a resend may grade these samples again") {
		t.Error("the lost write was not logged")
	}

	_, err := client.Grade(testContext(t), gradeReq(t, "r1", "x", "a"))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("resend with NATS gone: %v, want Unavailable", err)
	}
	if c.count() != 1 {
		t.Fatalf("grader ran %d times, want 1", c.count())
	}
}

// The longest rollout id a request may carry is a key the bucket takes.
func TestLongestRolloutIDIsStored(t *testing.T) {
	c := newCounter(nil)
	client := stub(t, startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"}))
	rid := strings.Repeat("é", 512) // 1024 bytes
	wantGrade(t, "first", grade(t, client, gradeReq(t, rid, "x", "a")), 0, 1, false)
	wantGrade(t, "resend", grade(t, client, gradeReq(t, rid, "x", "a")), 0, 1, true)
	if c.count() != 1 {
		t.Fatalf("grader ran %d times, want 1", c.count())
	}
}

func logged(recs []logRecord, msg string) bool {
	for _, r := range recs {
		if r.msg == msg {
			return true
		}
	}
	return false
}
