package grader_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/services/grader"
)

// startClient runs a Client over conn until the test ends.
func startClient(t *testing.T, conn grpc.ClientConnInterface) *grader.Client {
	t.Helper()
	c := grader.NewClient(conn, grader.ClientOptions{Logger: quietLogger(), ReconnectMin: 10 * time.Millisecond, ReconnectMax: 100 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(testTimeout):
			t.Error("Run did not return after its context ended")
		}
	})
	return c
}

// rewardFromID is a grader that rewards each rollout with the number at the
// end of its id ("r17" -> 17), so an answer delivered to the wrong caller
// shows.
func rewardFromID(gc *osmo.GraderContext) error {
	i := strings.LastIndexFunc(gc.RolloutID, func(r rune) bool { return r < '0' || r > '9' })
	n, err := strconv.Atoi(gc.RolloutID[i+1:])
	if err != nil {
		return err
	}
	for id := range gc.Samples {
		if err := gc.SetSampleReward(id, float64(n)); err != nil {
			return err
		}
	}
	return nil
}

type result struct {
	i    int
	resp *graderv1.GradeResponse
	err  error
}

func TestClientMultiplexesOneStream(t *testing.T) {
	const n = 200
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error { return rewardFromID(gc) })
	rc := &recvCounter{}
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"},
		grpc.StreamInterceptor(rc.intercept))
	client := startClient(t, dial(t, ts.addr))
	ctx := testContext(t)

	results := make(chan result, n)
	for i := range n {
		go func() {
			// As the rollout service sends them: a first attempt, which
			// the client must not send again as one.
			req := gradeReq(t, fmt.Sprintf("r%d", i), "x", "a")
			req.FirstAttempt = true
			resp, err := client.Grade(ctx, req)
			results <- result{i, resp, err}
		}()
	}
	for range n {
		r := <-results
		if r.err != nil {
			t.Fatalf("r%d: %v", r.i, r.err)
		}
		if r.resp.GetRolloutId() != fmt.Sprintf("r%d", r.i) || r.resp.GetError() != "" || r.resp.GetGrades()[0].GetReward() != float64(r.i) {
			t.Fatalf("r%d answered %v", r.i, r.resp)
		}
	}
	if s := rc.streams.Load(); s != 1 {
		t.Fatalf("%d streams opened, want 1", s)
	}
	if c.count() != n || rc.requests.Load() != n {
		t.Fatalf("grader ran %d times over %d requests, want %d", c.count(), rc.requests.Load(), n)
	}
}

func TestClientJoinsAPendingRollout(t *testing.T) {
	release := make(chan struct{})
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		<-release
		return rewardFromID(gc)
	})
	rc := &recvCounter{}
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"},
		grpc.StreamInterceptor(rc.intercept))
	client := startClient(t, dial(t, ts.addr))
	ctx := testContext(t)

	results := make(chan result, 3)
	for i := range 3 {
		go func() {
			resp, err := client.Grade(ctx, gradeReq(t, "r7", "x", "a"))
			results <- result{i, resp, err}
		}()
	}
	waitFor(t, "three callers waiting", func() bool { return c.count() == 1 && grader.PendingWaiters(client, "r7") == 3 })
	close(release)
	for range 3 {
		r := <-results
		if r.err != nil || r.resp.GetGrades()[0].GetReward() != 7 {
			t.Fatalf("%v %v", r.resp, r.err)
		}
	}
	if rc.requests.Load() != 1 {
		t.Fatalf("%d requests sent for one rollout, want 1", rc.requests.Load())
	}
}

func TestClientGradeRejectsInvalidRequests(t *testing.T) {
	client := grader.NewClient(dial(t, "127.0.0.1:1"), grader.ClientOptions{Logger: quietLogger()})
	_, err := client.Grade(testContext(t), &graderv1.GradeRequest{})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "rollout_id") {
		t.Fatalf("%v", err)
	}
}

func TestClientGradeHonoursItsContext(t *testing.T) {
	// Nothing listens here: the call stays pending until its context ends.
	client := startClient(t, dial(t, "127.0.0.1:1"))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a"))
	if status.Code(err) == codes.OK || !strings.Contains(err.Error(), "deadline exceeded") {
		t.Fatalf("%v", err)
	}
}

func TestClientRunOnlyOnce(t *testing.T) {
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(nil)}, Default: "g"})
	client := grader.NewClient(dial(t, ts.addr), grader.ClientOptions{Logger: quietLogger()})
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- client.Run(ctx) }()
	// An answer proves the first Run is active.
	if _, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a")); err != nil {
		t.Fatal(err)
	}
	if err := client.Run(ctx); err == nil || !strings.Contains(err.Error(), "already running") {
		t.Fatalf("second Run: %v, want an error", err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run returned %v after its context ended, want nil", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Run did not return")
	}
}

// A request the connection cannot carry fails alone instead of breaking
// the stream for everyone on each resend.
func TestClientOversizedRequestFailsAlone(t *testing.T) {
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(func(_ context.Context, gc *osmo.GraderContext) error { return rewardFromID(gc) })}, Default: "g"})
	client := startClient(t, dial(t, ts.addr, grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(4096))))
	ctx := testContext(t)
	big := gradeReq(t, "big1", "x", strings.Repeat("x", 8192))
	if _, err := client.Grade(ctx, big); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("oversized: %v, want ResourceExhausted", err)
	}
	resp, err := client.Grade(ctx, gradeReq(t, "r3", "x", "a"))
	if err != nil || resp.GetGrades()[0].GetReward() != 3 {
		t.Fatalf("after the oversized request: %v %v", resp, err)
	}
}

// TestClientSurvivesGraderRestart kills the grader mid-grading and starts a
// new one on the same address and store. Every Grade call must get its
// reward and every rollout must be graded exactly once:
//   - group A is answered before the kill;
//   - group B is graded and stored, but the answer is lost with the
//     connection: the new grader must answer the resend from the store;
//   - group C is still being graded at the kill: the new grader grades it.
func TestClientSurvivesGraderRestart(t *testing.T) {
	const n = 30
	group := func(rid string) byte {
		i, _ := strconv.Atoi(strings.TrimPrefix(rid, "r"))
		return "ABC"[i%3]
	}

	var (
		mu        sync.Mutex
		completed = map[string]int{} // rollout -> finished gradings, both servers
		entered   = map[string]bool{}
	)
	finish := func(gc *osmo.GraderContext) error {
		if err := rewardFromID(gc); err != nil {
			return err
		}
		mu.Lock()
		completed[gc.RolloutID]++
		mu.Unlock()
		return nil
	}
	grader1 := osmo.GraderFunc(func(ctx context.Context, gc *osmo.GraderContext) error {
		mu.Lock()
		entered[gc.RolloutID] = true
		mu.Unlock()
		if group(gc.RolloutID) == 'C' {
			<-ctx.Done() // killed before it finishes
			return ctx.Err()
		}
		return finish(gc)
	})
	grader2 := osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error { return finish(gc) })
	count := func(g byte) (done, started int) {
		mu.Lock()
		defer mu.Unlock()
		for rid, k := range completed {
			if group(rid) == g {
				done += k
			}
		}
		for rid := range entered {
			if group(rid) == g {
				started++
			}
		}
		return done, started
	}

	// The first server loses its answers to group B, as if it died between
	// storing them and sending them.
	drop := grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return handler(srv, &droppingStream{ServerStream: ss, drop: func(rid string) bool { return group(rid) == 'B' }})
	})
	cfg := grader.Config{Graders: map[string]osmo.Grader{"g": grader1}, Default: "g", State: openState(t, "")}
	srv1 := startServer(t, "127.0.0.1:0", cfg, drop)
	addr := srv1.addr

	client := startClient(t, dial(t, addr))
	ctx := testContext(t)
	results := make(chan result, n)
	for i := range n {
		go func() {
			// As the rollout service sends them: a first attempt, which
			// the client must not send again as one.
			req := gradeReq(t, fmt.Sprintf("r%d", i), "x", "a")
			req.FirstAttempt = true
			resp, err := client.Grade(ctx, req)
			results <- result{i, resp, err}
		}()
	}
	got := map[int]*graderv1.GradeResponse{}
	for len(got) < n/3 {
		select {
		case r := <-results:
			if r.err != nil {
				t.Fatalf("r%d: %v", r.i, r.err)
			}
			if group(fmt.Sprintf("r%d", r.i)) != 'A' {
				t.Fatalf("r%d answered before the restart", r.i)
			}
			got[r.i] = r.resp
		case <-ctx.Done():
			t.Fatal("group A not answered")
		}
	}
	waitFor(t, "group B graded and group C grading", func() bool {
		b, _ := count('B')
		_, c := count('C')
		return b == n/3 && c == n/3
	})

	srv1.kill(t)
	cfg.Graders = map[string]osmo.Grader{"g": grader2}
	startServer(t, addr, cfg)

	for len(got) < n {
		select {
		case r := <-results:
			if r.err != nil {
				t.Fatalf("r%d: %v", r.i, r.err)
			}
			got[r.i] = r.resp
		case <-ctx.Done():
			t.Fatalf("only %d of %d rollouts answered after the restart", len(got), n)
		}
	}
	for i, resp := range got {
		rid := fmt.Sprintf("r%d", i)
		g := resp.GetGrades()
		if resp.GetError() != "" || len(g) != 1 || g[0].GetReward() != float64(i) {
			t.Fatalf("%s: %v", rid, resp)
		}
		if wantCached := group(rid) == 'B'; g[0].GetCached() != wantCached {
			t.Errorf("%s (group %c): cached=%v, want %v", rid, group(rid), g[0].GetCached(), wantCached)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	total := 0
	for rid, k := range completed {
		if k != 1 {
			t.Errorf("%s graded %d times", rid, k)
		}
		total += k
	}
	if total != n {
		t.Fatalf("%d gradings for %d rollouts", total, n)
	}
}

// droppingStream swallows the answers drop selects.
type droppingStream struct {
	grpc.ServerStream
	drop func(rolloutID string) bool
}

func (s *droppingStream) SendMsg(m any) error {
	if resp, ok := m.(*graderv1.GradeResponse); ok && s.drop(resp.GetRolloutId()) {
		return nil
	}
	return s.ServerStream.SendMsg(m)
}

// Requests made while the grader is down are delivered once it is up.
func TestClientWaitsForAGraderThatIsDown(t *testing.T) {
	addr := freeAddr(t)
	client := startClient(t, dial(t, addr))
	ctx := testContext(t)
	results := make(chan result, 5)
	for i := range 5 {
		go func() {
			// As the rollout service sends them: a first attempt, which
			// the client must not send again as one.
			req := gradeReq(t, fmt.Sprintf("r%d", i), "x", "a")
			req.FirstAttempt = true
			resp, err := client.Grade(ctx, req)
			results <- result{i, resp, err}
		}()
	}
	time.Sleep(150 * time.Millisecond) // a few failed connection attempts
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error { return rewardFromID(gc) })
	startServer(t, addr, grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	for range 5 {
		r := <-results
		if r.err != nil || r.resp.GetGrades()[0].GetReward() != float64(r.i) {
			t.Fatalf("r%d: %v %v", r.i, r.resp, r.err)
		}
	}
	if c.count() != 5 {
		t.Fatalf("grader ran %d times, want 5", c.count())
	}
}

// freeAddr returns a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestClientIgnoresTheAnswerOfAnAbandonedRequest: a caller gives up on a
// rollout's grading, a newer request for the same rollout id follows (a
// rollout reusing the id), and the first request's answer arrives while
// the newer one waits. It must not be taken for the newer one's.
func TestClientIgnoresTheAnswerOfAnAbandonedRequest(t *testing.T) {
	releaseOld, releaseNew := make(chan struct{}), make(chan struct{})
	oldGraded := make(chan struct{})
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		label := ""
		if gc.Label != nil {
			label = *gc.Label
		}
		reward := 2.0
		if label == "old" {
			<-releaseOld
			reward = 1
			defer close(oldGraded)
		} else {
			<-releaseNew
		}
		for id := range gc.Samples {
			if err := gc.SetSampleReward(id, reward); err != nil {
				return err
			}
		}
		return nil
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	client := startClient(t, dial(t, ts.addr))

	short, cancel := context.WithCancel(testContext(t))
	abandoned := make(chan error, 1)
	go func() {
		_, err := client.Grade(short, gradeReq(t, "r1", "old", "a"))
		abandoned <- err
	}()
	waitFor(t, "the old request being graded", func() bool { return c.count() == 1 })
	cancel()
	if err := <-abandoned; err == nil {
		t.Fatal("the abandoned Grade returned no error")
	}

	answer := make(chan result, 1)
	go func() {
		resp, err := client.Grade(testContext(t), gradeReq(t, "r1", "new", "a"))
		answer <- result{0, resp, err}
	}()
	waitFor(t, "the new request waiting", func() bool { return grader.PendingWaiters(client, "r1") == 1 })
	close(releaseOld) // the old answer arrives first
	<-oldGraded
	select {
	case r := <-answer:
		t.Fatalf("the new request took an answer before its own was graded: %v %v", r.resp, r.err)
	case <-time.After(100 * time.Millisecond):
	}
	close(releaseNew)
	r := <-answer
	if r.err != nil || r.resp.GetGrades()[0].GetReward() != 2 {
		t.Fatalf("the new request's answer: %v %v, want reward 2", r.resp, r.err)
	}
}
