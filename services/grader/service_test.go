package grader_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/services/grader"
)

func TestGraderOutcomes(t *testing.T) {
	never := make(chan struct{})
	t.Cleanup(func() { close(never) })
	tests := []struct {
		name    string
		grade   func(ctx context.Context, gc *osmo.GraderContext) error
		answers []string
		check   func(t *testing.T, resp *graderv1.GradeResponse)
		wantErr string // substring of GradeResponse.error; "" means success
	}{
		{
			name: "reward per sample",
			grade: func(_ context.Context, gc *osmo.GraderContext) error {
				if err := gc.SetSampleReward("s0", 0.25); err != nil {
					return err
				}
				return gc.SetSampleReward("s1", -1)
			},
			answers: []string{"a", "b"},
			check: func(t *testing.T, resp *graderv1.GradeResponse) {
				want := map[string]float64{"s0": 0.25, "s1": -1}
				if len(resp.GetGrades()) != 2 {
					t.Fatalf("grades: %v", resp.GetGrades())
				}
				for _, g := range resp.GetGrades() {
					if g.Reward == nil || g.GetReward() != want[g.GetSampleId()] || g.GetRemoveSample() || g.GetCached() {
						t.Errorf("grade %v, want reward %v", g, want[g.GetSampleId()])
					}
				}
			},
		},
		{
			name: "remove sample",
			grade: func(_ context.Context, gc *osmo.GraderContext) error {
				if err := gc.RemoveSample("s0"); err != nil {
					return err
				}
				return gc.SetSampleReward("s1", 1)
			},
			answers: []string{"a", "b"},
			check: func(t *testing.T, resp *graderv1.GradeResponse) {
				g := resp.GetGrades()
				if len(g) != 2 || g[0].GetSampleId() != "s0" || !g[0].GetRemoveSample() || g[0].Reward != nil {
					t.Fatalf("s0: %v", g)
				}
				if g[1].GetRemoveSample() || g[1].GetReward() != 1 {
					t.Fatalf("s1: %v", g[1])
				}
			},
		},
		{
			name: "grader error",
			grade: func(context.Context, *osmo.GraderContext) error {
				return fmt.Errorf("judge unreachable: %w", errBoom)
			},
			answers: []string{"a"},
			wantErr: `grader "g": failed: judge unreachable: boom`,
		},
		{
			name: "NaN refused by SetSampleReward and returned",
			grade: func(_ context.Context, gc *osmo.GraderContext) error {
				return gc.SetSampleReward("s0", math.NaN())
			},
			answers: []string{"a"},
			wantErr: "finite",
		},
		{
			name: "NaN refused and the refusal ignored",
			grade: func(_ context.Context, gc *osmo.GraderContext) error {
				_ = gc.SetSampleReward("s0", math.Inf(1))
				return nil
			},
			answers: []string{"a"},
			wantErr: `left samples without a reward or remove_sample: "s0"`,
		},
		{
			name:    "panic",
			grade:   func(context.Context, *osmo.GraderContext) error { panic("index out of range") },
			answers: []string{"a"},
			wantErr: `grader "g": panicked: index out of range`,
		},
		{
			name: "timeout honoured by the grader",
			grade: func(ctx context.Context, _ *osmo.GraderContext) error {
				<-ctx.Done()
				return ctx.Err()
			},
			answers: []string{"a"},
			wantErr: `grader "g": timed out after 50ms`,
		},
		{
			name: "timeout ignored by the grader",
			grade: func(_ context.Context, gc *osmo.GraderContext) error {
				<-never
				return gc.SetSampleReward("s0", 1)
			},
			answers: []string{"a"},
			wantErr: "timed out after 50ms",
		},
		{
			name: "sample left ungraded",
			grade: func(_ context.Context, gc *osmo.GraderContext) error {
				return gc.SetSampleReward("s0", 1)
			},
			answers: []string{"a", "b", "c"},
			wantErr: `left samples without a reward or remove_sample: "s1", "s2"`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, "127.0.0.1:0", grader.Config{
				Graders: map[string]osmo.Grader{"g": osmo.GraderFunc(tc.grade)},
				Default: "g",
				Timeout: 50 * time.Millisecond,
			})
			resp, err := stub(t, ts).Grade(testContext(t), gradeReq(t, "r1", "x", tc.answers...))
			if err != nil {
				t.Fatalf("Grade: %v", err)
			}
			if resp.GetRolloutId() != "r1" || resp.GetGrader() != "g" {
				t.Errorf("rollout_id %q grader %q", resp.GetRolloutId(), resp.GetGrader())
			}
			if tc.wantErr != "" {
				if !strings.Contains(resp.GetError(), tc.wantErr) {
					t.Fatalf("error %q, want one containing %q", resp.GetError(), tc.wantErr)
				}
				if len(resp.GetGrades()) != 0 {
					t.Fatalf("a failed grading must carry no rewards, got %v", resp.GetGrades())
				}
				return
			}
			if resp.GetError() != "" {
				t.Fatalf("unexpected error %q", resp.GetError())
			}
			tc.check(t, resp)
		})
	}
}

// The grader sees the request the way the SDK describes it: messages as
// maps, the label, metadata and per-sample fields.
func TestGraderContextFromRequest(t *testing.T) {
	var seen *osmo.GraderContext
	g := osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
		seen = gc
		return gc.SetSampleReward("agent", 1)
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g"})
	md, _ := structpb.NewStruct(map[string]any{"difficulty": "hard"})
	extra, _ := structpb.NewStruct(map[string]any{"k": 1.0})
	msg, _ := structpb.NewStruct(map[string]any{"role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "42"}}})
	req := &graderv1.GradeRequest{
		RolloutId: "r1",
		Label:     proto.String("42"),
		Metadata:  md,
		Samples: []*rolloutv1.RolloutSample{{
			Id: "agent", Messages: []*structpb.Struct{msg}, ExtraFields: extra,
			AgentReward: proto.Float64(0.5), FinishReason: "stop",
		}},
		RequestId: 77,
	}
	resp, err := stub(t, ts).Grade(testContext(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetRequestId() != 77 {
		t.Errorf("answer's request_id %d, want the request's 77", resp.GetRequestId())
	}
	if seen == nil || seen.RolloutID != "r1" || seen.Label == nil || *seen.Label != "42" || seen.Metadata["difficulty"] != "hard" {
		t.Fatalf("context: %+v", seen)
	}
	s := seen.Samples["agent"]
	if s == nil || osmo.LastAssistantText(s.Messages) != "42" || s.AgentReward == nil || *s.AgentReward != 0.5 ||
		s.FinishReason != "stop" || s.ExtraFields["k"] != 1.0 || s.Label == nil || *s.Label != "42" || s.Metadata["difficulty"] != "hard" {
		t.Fatalf("sample: %+v", s)
	}
}

func TestBuiltinGradersThroughTheService(t *testing.T) {
	set := map[string]osmo.Grader{}
	for _, name := range graders.Names() {
		g, err := graders.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		set[name] = g
	}
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: set, Default: "calculator"})
	client := stub(t, ts)
	ctx := testContext(t)

	resp, err := client.Grade(ctx, gradeReq(t, "calc", "42", "6 * 7 = 42", "41"))
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetGrader() != "calculator" || resp.GetError() != "" || resp.GetGrades()[0].GetReward() != 1 || resp.GetGrades()[1].GetReward() != 0 {
		t.Fatalf("calculator: %v", resp)
	}

	// No request label: the samples' common label stands in.
	req := gradeReq(t, "exact", "", "42")
	req.Label = nil
	req.Samples[0].Label = proto.String("42")
	req.Grader = "exact"
	if resp, err = client.Grade(ctx, req); err != nil || resp.GetError() != "" || resp.GetGrades()[0].GetReward() != 1 {
		t.Fatalf("exact with sample label: %v %v", resp, err)
	}

	// No label anywhere: an error, never a silent 0.
	req = gradeReq(t, "nolabel", "", "42")
	req.Label = nil
	req.Grader = "numeric"
	if resp, err = client.Grade(ctx, req); err != nil || !strings.Contains(resp.GetError(), "no label") || len(resp.GetGrades()) != 0 {
		t.Fatalf("numeric without label: %v %v", resp, err)
	}
}

func TestInvalidRequests(t *testing.T) {
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(nil)}, Default: "g"})
	client := stub(t, ts)
	tests := []struct {
		name  string
		edit  func(*graderv1.GradeRequest)
		field string
	}{
		{"no rollout id", func(r *graderv1.GradeRequest) { r.RolloutId = "" }, "rollout_id"},
		{"rollout id too long", func(r *graderv1.GradeRequest) { r.RolloutId = strings.Repeat("x", 1025) }, "rollout_id"},
		{"no samples", func(r *graderv1.GradeRequest) { r.Samples = nil }, "samples"},
		{"empty sample id", func(r *graderv1.GradeRequest) { r.Samples[1].Id = "" }, "samples[1].id"},
		{"duplicate sample id", func(r *graderv1.GradeRequest) { r.Samples[1].Id = "s0" }, "samples[1].id"},
		{"sample of another rollout", func(r *graderv1.GradeRequest) { r.Samples[0].RolloutId = "other" }, "samples[0].rollout_id"},
		{"unknown grader", func(r *graderv1.GradeRequest) { r.Grader = "nope" }, "grader"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := gradeReq(t, "r1", "x", "a", "b")
			tc.edit(req)
			_, err := client.Grade(testContext(t), req)
			st := status.Convert(err)
			if st.Code() != codes.InvalidArgument {
				t.Fatalf("code %v (%v), want InvalidArgument", st.Code(), err)
			}
			if !strings.HasPrefix(st.Message(), tc.field+":") {
				t.Errorf("message %q does not start with the field %q", st.Message(), tc.field)
			}
			var field string
			for _, d := range st.Details() {
				if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) == 1 {
					field = br.GetFieldViolations()[0].GetField()
				}
			}
			if field != tc.field {
				t.Errorf("BadRequest field %q, want %q", field, tc.field)
			}
		})
	}
	t.Run("unknown grader lists the known ones", func(t *testing.T) {
		req := gradeReq(t, "r1", "x", "a")
		req.Grader = "nope"
		_, err := client.Grade(testContext(t), req)
		if msg := status.Convert(err).Message(); !strings.Contains(msg, `"nope"`) || !strings.Contains(msg, "known: g") {
			t.Fatalf("message %q", msg)
		}
	})
}

func TestNewRejectsBadConfig(t *testing.T) {
	g := newCounter(nil)
	tests := []struct {
		name string
		cfg  grader.Config
		want string
	}{
		{"no graders", grader.Config{}, "at least one grader"},
		{"unknown default", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "h"}, `unknown grader "h" (known: g)`},
		{"nil grader", grader.Config{Graders: map[string]osmo.Grader{"g": nil}}, `grader "g" is nil`},
		{"negative timeout", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Timeout: -1}, "must not be negative"},
		{"no state", grader.Config{Graders: map[string]osmo.Grader{"g": g}}, "State: required"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			svc, err := grader.New(testContext(t), tc.cfg)
			if err == nil {
				svc.Close()
				t.Fatal("New succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "grader.New: ") {
				t.Fatalf("error %q, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestNoDefaultGraderNeedsANamedOne(t *testing.T) {
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(nil)}})
	client := stub(t, ts)
	_, err := client.Grade(testContext(t), gradeReq(t, "r1", "x", "a"))
	if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), "grader: required") {
		t.Fatalf("%v", err)
	}
	req := gradeReq(t, "r1", "x", "a")
	req.Grader = "g"
	if resp, err := client.Grade(testContext(t), req); err != nil || resp.GetGrader() != "g" {
		t.Fatalf("%v %v", resp, err)
	}
}

func TestResentRolloutIsGradedOnce(t *testing.T) {
	c := newCounter(nil)
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	client := stub(t, ts)
	ctx := testContext(t)
	first, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a", "b"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		again, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a", "b"))
		if err != nil {
			t.Fatal(err)
		}
		for j, g := range again.GetGrades() {
			if !g.GetCached() || g.GetReward() != first.GetGrades()[j].GetReward() || g.GetSampleId() != first.GetGrades()[j].GetSampleId() {
				t.Fatalf("resend %d: %v, first answer %v", i, g, first.GetGrades()[j])
			}
		}
	}
	if first.GetGrades()[0].GetCached() {
		t.Fatal("the first answer is not cached")
	}
	if c.count() != 1 {
		t.Fatalf("grader ran %d times, want 1", c.count())
	}

	// A resend with one more sample grades only the new one.
	resp, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a", "b", "c"))
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGrades()
	if len(g) != 3 || !g[0].GetCached() || !g[1].GetCached() || g[2].GetCached() || g[2].GetSampleId() != "s2" {
		t.Fatalf("grades %v", g)
	}
	if c.graded("r1/s0") != 1 || c.graded("r1/s2") != 1 {
		t.Fatalf("s0 graded %d times, s2 %d times", c.graded("r1/s0"), c.graded("r1/s2"))
	}
}

// TestFirstAttemptIsNotLookedUp: a request its sender marks as a first
// attempt is graded without reading the store (the read is a NATS round
// trip per rollout), and stored for a resend to find; without the mark
// the store answers. The mark is the sender's word: set on a resend, the
// samples are graded again, which is how the test sees the read skipped.
func TestFirstAttemptIsNotLookedUp(t *testing.T) {
	c := newCounter(nil)
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	client := stub(t, ts)
	ctx := testContext(t)
	first := gradeReq(t, "r1", "x", "a")
	first.FirstAttempt = true
	if resp, err := client.Grade(ctx, first); err != nil || resp.GetGrades()[0].GetCached() {
		t.Fatalf("first attempt: %v, %v", resp, err)
	}
	if resp, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a")); err != nil || !resp.GetGrades()[0].GetCached() {
		t.Fatalf("resend: %v, %v; want the stored grading", resp, err)
	}
	if c.count() != 1 {
		t.Fatalf("grader ran %d times for a first attempt and a resend, want 1", c.count())
	}
	if resp, err := client.Grade(ctx, first); err != nil || resp.GetGrades()[0].GetCached() {
		t.Fatalf("a resend marked first: %v, %v; want it graded afresh", resp, err)
	}
	if c.count() != 2 {
		t.Fatalf("grader ran %d times, want 2: a request marked first was answered from the store", c.count())
	}
}

func TestFailedGradingIsCached(t *testing.T) {
	c := newCounter(func(context.Context, *osmo.GraderContext) error { return errBoom })
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	client := stub(t, ts)
	ctx := testContext(t)
	var errs []string
	for range 2 {
		resp, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a"))
		if err != nil {
			t.Fatal(err)
		}
		errs = append(errs, resp.GetError())
	}
	if errs[0] == "" || errs[0] != errs[1] {
		t.Fatalf("errors %q", errs)
	}
	if c.count() != 1 {
		t.Fatalf("grader ran %d times, want 1", c.count())
	}
}

func TestConcurrentDuplicatesWaitForOneGrading(t *testing.T) {
	const n = 12
	release := make(chan struct{})
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		<-release
		for id := range gc.Samples {
			if err := gc.SetSampleReward(id, 0.75); err != nil {
				return err
			}
		}
		return nil
	})
	rc := &recvUnary{}
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"},
		rc.option())
	client := stub(t, ts)
	ctx := testContext(t)

	resps := make(chan *graderv1.GradeResponse, n)
	errc := make(chan error, n)
	for range n {
		go func() {
			resp, err := client.Grade(ctx, gradeReq(t, "dup", "x", "a"))
			if err != nil {
				errc <- err
				return
			}
			resps <- resp
		}()
	}
	// Release the grader once every request has reached the service, so
	// they overlap the one grading.
	waitFor(t, "all requests in", func() bool { return rc.calls.Load() == n && c.count() >= 1 })
	close(release)
	fresh := 0
	for range n {
		select {
		case resp := <-resps:
			if resp.GetError() != "" || resp.GetGrades()[0].GetReward() != 0.75 {
				t.Fatalf("answer %v", resp)
			}
			if !resp.GetGrades()[0].GetCached() {
				fresh++
			}
		case err := <-errc:
			t.Fatal(err)
		case <-ctx.Done():
			t.Fatal("answers did not arrive")
		}
	}
	if c.count() != 1 || fresh != 1 {
		t.Fatalf("grader ran %d times, %d answers uncached; want 1 and 1", c.count(), fresh)
	}
}

// A request that waits for the pass of an in-process first attempt (a
// grading not kept, without fingerprints) is not answered from it: it is
// graded on its own once that pass ends, and both are answered.
func TestWaiterOfAnUnkeptGrading(t *testing.T) {
	release := make(chan struct{})
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		<-release
		for id := range gc.Samples {
			if err := gc.SetSampleReward(id, 0.5); err != nil {
				return err
			}
		}
		return nil
	})
	rc := &recvUnary{}
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"}, rc.option())
	client := stub(t, ts)
	ctx := testContext(t)

	type result struct {
		resp *graderv1.GradeResponse
		err  error
	}
	local, remote := make(chan result, 1), make(chan result, 1)
	go func() {
		first := gradeReq(t, "unkept", "x", "a")
		first.FirstAttempt = true
		resp, err := ts.svc.GradeLocal(ctx, first)
		local <- result{resp, err}
	}()
	waitFor(t, "the in-process grading", func() bool { return c.count() == 1 })
	go func() {
		resp, err := client.Grade(ctx, gradeReq(t, "unkept", "x", "a"))
		remote <- result{resp, err}
	}()
	waitFor(t, "the waiting request", func() bool { return rc.calls.Load() == 1 })
	close(release)
	for name, ch := range map[string]chan result{"in process": local, "over gRPC": remote} {
		select {
		case r := <-ch:
			if r.err != nil || r.resp.GetError() != "" || r.resp.GetGrades()[0].GetReward() != 0.5 || r.resp.GetGrades()[0].GetCached() {
				t.Fatalf("%s: %v, %v; want a fresh reward of 0.5", name, r.resp, r.err)
			}
		case <-ctx.Done():
			t.Fatalf("%s: no answer", name)
		}
	}
	if c.count() != 2 {
		t.Fatalf("grader ran %d times, want 2 (the waiter graded on its own)", c.count())
	}
}

// A request that overlaps a grading of other samples of the same rollout
// waits for it, then grades only what that grading did not cover.
func TestOverlappingRequestsForOneRollout(t *testing.T) {
	release := make(chan struct{})
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		if _, first := gc.Samples["s0"]; first {
			<-release
		}
		for id := range gc.Samples {
			if err := gc.SetSampleReward(id, 1); err != nil {
				return err
			}
		}
		return nil
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	client := stub(t, ts)
	ctx := testContext(t)

	firstDone := make(chan error, 1)
	go func() {
		_, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a"))
		firstDone <- err
	}()
	waitFor(t, "first grading", func() bool { return c.count() == 1 })
	secondDone := make(chan *graderv1.GradeResponse, 1)
	go func() {
		resp, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a", "b"))
		if err != nil {
			t.Error(err)
		}
		secondDone <- resp
	}()
	close(release)
	if err := <-firstDone; err != nil {
		t.Fatal(err)
	}
	resp := <-secondDone
	if resp.GetError() != "" || len(resp.GetGrades()) != 2 || !resp.GetGrades()[0].GetCached() {
		t.Fatalf("second answer %v", resp)
	}
	if c.graded("r1/s0") != 1 || c.graded("r1/s1") != 1 {
		t.Fatalf("s0 graded %d times, s1 %d times", c.graded("r1/s0"), c.graded("r1/s1"))
	}
}

func TestResultsExpire(t *testing.T) {
	c := newCounter(nil)
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", ResultTTL: 30 * time.Millisecond})
	client := stub(t, ts)
	ctx := testContext(t)
	if _, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(40 * time.Millisecond)
	resp, err := client.Grade(ctx, gradeReq(t, "r1", "x", "a"))
	if err != nil {
		t.Fatal(err)
	}
	if c.count() != 2 || resp.GetGrades()[0].GetCached() {
		t.Fatalf("after the TTL: grader ran %d times, cached=%v", c.count(), resp.GetGrades()[0].GetCached())
	}
}

func TestMaxConcurrentBoundsRunningGraders(t *testing.T) {
	var active, peak atomic.Int64
	g := osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
		n := active.Add(1)
		defer active.Add(-1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		time.Sleep(5 * time.Millisecond)
		return gc.SetSampleReward("s0", 1)
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g", MaxConcurrent: 2})
	client := stub(t, ts)
	ctx := testContext(t)
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := client.Grade(ctx, gradeReq(t, fmt.Sprintf("r%d", i), "x", "a"))
			if err != nil || resp.GetError() != "" {
				t.Errorf("%v %v", resp, err)
			}
		}()
	}
	wg.Wait()
	if p := peak.Load(); p > 2 || p < 1 {
		t.Fatalf("peak concurrency %d, want 1..2", p)
	}
}

func TestEveryRequestLogCarriesTheRolloutID(t *testing.T) {
	var sink logSink
	g := osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
		if gc.RolloutID == "bad" {
			panic("boom")
		}
		return gc.SetSampleReward("s0", 1)
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g", Logger: sink.logger()})
	client := stub(t, ts)
	ctx := testContext(t)
	for _, rid := range []string{"good", "good", "bad"} {
		if _, err := client.Grade(ctx, gradeReq(t, rid, "x", "a")); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]bool{}
	for _, r := range sink.records() {
		seen[r.msg] = true
		if r.attrs["rollout_id"] == nil {
			t.Errorf("record %q has no rollout_id: %v", r.msg, r.attrs)
		}
		if r.msg == "sample graded" && r.attrs["sample_id"] != "s0" {
			t.Errorf("record %q has no sample_id: %v", r.msg, r.attrs)
		}
	}
	for _, msg := range []string{"graded", "sample graded", "answered from an earlier grading", "grader panicked", "grading failed"} {
		if !seen[msg] {
			t.Errorf("no %q record", msg)
		}
	}
}

func TestGradeStream(t *testing.T) {
	c := newCounter(nil)
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	ctx := testContext(t)
	stream, err := stub(t, ts).GradeStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	bad := gradeReq(t, "bad", "x", "a", "b")
	bad.Samples[1].Id = "s0"
	reqs := []*graderv1.GradeRequest{gradeReq(t, "r1", "x", "a"), bad, gradeReq(t, "r2", "x", "a"), gradeReq(t, "r1", "x", "a")}
	for _, r := range reqs {
		if err := stream.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	// Every request is answered, the bad one with an error, and the
	// stream then ends cleanly.
	byRollout := map[string][]*graderv1.GradeResponse{}
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		byRollout[resp.GetRolloutId()] = append(byRollout[resp.GetRolloutId()], resp)
	}
	if b := byRollout["bad"]; len(b) != 1 || !strings.Contains(b[0].GetError(), "invalid request: samples[1].id") {
		t.Fatalf("bad: %v", b)
	}
	if len(byRollout["r1"]) != 2 || len(byRollout["r2"]) != 1 || byRollout["r2"][0].GetGrades()[0].GetReward() != 1 {
		t.Fatalf("answers %v", byRollout)
	}
	if c.count() != 2 {
		t.Fatalf("grader ran %d times, want 2", c.count())
	}
}

func TestGradeStreamEndsWhenTheServiceCloses(t *testing.T) {
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(nil)}, Default: "g"})
	ctx := testContext(t)
	stream, err := stub(t, ts).GradeStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(gradeReq(t, "r1", "x", "a")); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if err := ts.svc.Close(); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(gradeReq(t, "r2", "x", "a")); err != nil {
		t.Fatal(err)
	}
	_, err = stream.Recv()
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("Recv after Close: %v, want Unavailable", err)
	}
	if _, err := stub(t, ts).Grade(ctx, gradeReq(t, "r3", "x", "a")); status.Code(err) != codes.Unavailable {
		t.Fatalf("Grade after Close: %v, want Unavailable", err)
	}
}

// A stream with nothing to grade ends too when the service closes.
func TestIdleGradeStreamEndsWhenTheServiceCloses(t *testing.T) {
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(nil)}, Default: "g"})
	stream, err := stub(t, ts).GradeStream(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(gradeReq(t, "r1", "x", "a")); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if err := ts.svc.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("Recv on an idle stream after Close: %v, want Unavailable", err)
	}
}

// GradeLocal answers as a stream answers its client: a grading, and an
// invalid request as an answer with Error set (a validation failure);
// once the service is closed, an error.
func TestGradeLocal(t *testing.T) {
	c := newCounter(nil)
	svc, err := grader.New(testContext(t), grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", Logger: quietLogger(), State: openState(t, "")})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := svc.GradeLocal(testContext(t), gradeReq(t, "local-1", "42", "42"))
	if err != nil || resp.GetError() != "" || len(resp.GetGrades()) != 1 || resp.GetGrades()[0].GetReward() != 1 {
		t.Fatalf("GradeLocal = %v, %v", resp, err)
	}
	// Again: answered from the stored grading.
	if resp, err := svc.GradeLocal(testContext(t), gradeReq(t, "local-1", "42", "42")); err != nil || !resp.GetGrades()[0].GetCached() || c.runs != 1 {
		t.Errorf("second GradeLocal = %v, %v (graded %d times)", resp, err, c.runs)
	}
	// A first attempt in process is not stored: the same request sent
	// again, not as a first attempt, is graded again, and that one is
	// stored.
	first := gradeReq(t, "local-4", "42", "42")
	first.FirstAttempt = true
	if resp, err := svc.GradeLocal(testContext(t), first); err != nil || resp.GetGrades()[0].GetCached() || c.runs != 2 {
		t.Fatalf("first attempt: %v, %v (graded %d times)", resp, err, c.runs)
	}
	for i, want := range []bool{false, true} {
		resp, err := svc.GradeLocal(testContext(t), gradeReq(t, "local-4", "42", "42"))
		if err != nil || resp.GetGrades()[0].GetCached() != want || c.runs != 3 {
			t.Fatalf("resend %d after a first attempt = %v, %v (graded %d times); want cached %v", i+1, resp, err, c.runs, want)
		}
	}
	resp, err = svc.GradeLocal(testContext(t), &graderv1.GradeRequest{RolloutId: "local-2"})
	if err != nil || !strings.Contains(resp.GetError(), "invalid request: ") || resp.GetErrorCategory() != "validation_error" {
		t.Errorf("invalid request: %v, %v", resp, err)
	}
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.GradeLocal(testContext(t), gradeReq(t, "local-3", "42", "42")); status.Code(err) != codes.Unavailable {
		t.Errorf("after Close: %v, want Unavailable", err)
	}
}
