package grader_test

import (
	"context"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/services/grader"
)

// exactAnswer rewards 1 a sample whose last assistant message is the label,
// else 0, counting its runs.
func exactAnswer() *counter {
	return newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		for id, s := range gc.Samples {
			r := 0.0
			if s.Label != nil && osmo.LastAssistantText(s.Messages) == *s.Label {
				r = 1
			}
			if err := gc.SetSampleReward(id, r); err != nil {
				return err
			}
		}
		return nil
	})
}

// grade sends req and fails the test unless it is answered without error.
func grade(t *testing.T, client graderv1.GraderServiceClient, req *graderv1.GradeRequest) *graderv1.GradeResponse {
	t.Helper()
	resp, err := client.Grade(testContext(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetError() != "" || len(resp.GetGrades()) != len(req.GetSamples()) {
		t.Fatalf("answer %v", resp)
	}
	return resp
}

// wantGrade checks the answer for sample i of resp.
func wantGrade(t *testing.T, what string, resp *graderv1.GradeResponse, i int, reward float64, cached bool) {
	t.Helper()
	g := resp.GetGrades()[i]
	if g.Reward == nil || g.GetReward() != reward || g.GetCached() != cached {
		t.Fatalf("%s: %v, want reward %v cached %v", what, g, reward, cached)
	}
}

// A rollout id names a rollout only for as long as its owner remembers it:
// a request with the same ids but other content (a new rollout reusing the
// id, or another rollout service's) is graded on its own content, and its
// grading replaces the stored one for every service on the store.
func TestSampleWithOtherContentIsGradedAgain(t *testing.T) {
	tests := []struct {
		name   string
		change func(req *graderv1.GradeRequest)
		reward float64 // of the changed request
	}{
		{"label", func(req *graderv1.GradeRequest) { req.Label = proto.String("999") }, 0},
		{"messages", func(req *graderv1.GradeRequest) {
			req.Samples[0].Messages[1].Fields["content"] = structpb.NewStringValue("7")
		}, 0},
		{"metadata", func(req *graderv1.GradeRequest) {
			req.Metadata, _ = structpb.NewStruct(map[string]any{"difficulty": "hard"})
		}, 1},
		{"sample label", func(req *graderv1.GradeRequest) { req.Samples[0].Label = proto.String("7") }, 0},
		{"extra fields", func(req *graderv1.GradeRequest) {
			req.Samples[0].ExtraFields, _ = structpb.NewStruct(map[string]any{"k": 1.0})
		}, 1},
		{"grader", func(req *graderv1.GradeRequest) { req.Grader = "other" }, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := exactAnswer()
			cfg := grader.Config{Graders: map[string]osmo.Grader{"g": c, "other": c}, Default: "g", State: openState(t, "")}
			ts := startServer(t, "127.0.0.1:0", cfg)
			client := stub(t, ts)
			base := func() *graderv1.GradeRequest { return gradeReq(t, "r1", "6", "6") }
			changed := func() *graderv1.GradeRequest {
				req := base()
				tc.change(req)
				return req
			}

			wantGrade(t, "first", grade(t, client, base()), 0, 1, false)
			wantGrade(t, "changed", grade(t, client, changed()), 0, tc.reward, false)
			wantGrade(t, "changed, resent", grade(t, client, changed()), 0, tc.reward, true)
			// The first content's grading was replaced: it is graded again.
			wantGrade(t, "first, sent again", grade(t, client, base()), 0, 1, false)
			if c.count() != 3 {
				t.Fatalf("grader ran %d times, want 3", c.count())
			}

			// A service started again on the store (or another replica)
			// answers the latest content only.
			ts.kill(t)
			c2 := exactAnswer()
			cfg.Graders = map[string]osmo.Grader{"g": c2, "other": c2}
			client = stub(t, startServer(t, "127.0.0.1:0", cfg))
			wantGrade(t, "first, after restart", grade(t, client, base()), 0, 1, true)
			wantGrade(t, "changed, after restart", grade(t, client, changed()), 0, tc.reward, false)
			if c2.count() != 1 {
				t.Fatalf("the restarted service graded %d times, want 1", c2.count())
			}
		})
	}
}

// What does not change what the grader sees does not make a request new:
// naming the default grader, another trace context, another timeout.
func TestResendIsCachedWhateverItsTraceOrTimeout(t *testing.T) {
	c := exactAnswer()
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"})
	client := stub(t, ts)
	wantGrade(t, "first", grade(t, client, gradeReq(t, "r1", "6", "6")), 0, 1, false)
	req := gradeReq(t, "r1", "6", "6")
	req.Grader = "g"
	req.Timeout = durationpb.New(time.Minute)
	req.TraceContext = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	req.Samples[0].RolloutId = ""
	wantGrade(t, "resend", grade(t, client, req), 0, 1, true)
	if c.count() != 1 {
		t.Fatalf("grader ran %d times, want 1", c.count())
	}
}

// A request of several samples of which one changed grades only that one;
// the earlier grading keeps answering the others, across a restart too.
func TestOneChangedSampleOfSeveral(t *testing.T) {
	c := exactAnswer()
	cfg := grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", State: openState(t, "")}
	ts := startServer(t, "127.0.0.1:0", cfg)
	client := stub(t, ts)
	first := grade(t, client, gradeReq(t, "r1", "6", "6", "6"))
	wantGrade(t, "s0", first, 0, 1, false)
	wantGrade(t, "s1", first, 1, 1, false)
	second := grade(t, client, gradeReq(t, "r1", "6", "6", "5"))
	wantGrade(t, "s0 unchanged", second, 0, 1, true)
	wantGrade(t, "s1 changed", second, 1, 0, false)
	if c.graded("r1/s0") != 1 || c.graded("r1/s1") != 2 {
		t.Fatalf("s0 graded %d times, s1 %d times", c.graded("r1/s0"), c.graded("r1/s1"))
	}

	ts.kill(t)
	c2 := exactAnswer()
	cfg.Graders = map[string]osmo.Grader{"g": c2}
	client = stub(t, startServer(t, "127.0.0.1:0", cfg))
	again := grade(t, client, gradeReq(t, "r1", "6", "6", "5"))
	wantGrade(t, "s0 after restart", again, 0, 1, true)
	wantGrade(t, "s1 after restart", again, 1, 0, true)
	old := grade(t, client, gradeReq(t, "r1", "6", "6", "6"))
	wantGrade(t, "s0, first content", old, 0, 1, true)
	wantGrade(t, "s1, first content", old, 1, 1, false)
	if c2.count() != 1 || c2.graded("r1/s0") != 0 {
		t.Fatalf("the restarted service ran %d times, graded s0 %d times; want 1 and 0", c2.count(), c2.graded("r1/s0"))
	}
}

// A stored value that cannot answer a sample (a grading without a
// fingerprint, or a value that does not decode) has the sample graded once
// more, and the new grading then answers it, here and on a restarted
// service.
func TestStoredValueThatAnswersNothingIsRegraded(t *testing.T) {
	now := time.Now().UTC().Format(time.RFC3339Nano)
	tests := []struct {
		name, value, logged string
	}{
		{"no fingerprint", `[{"rollout_id":"r1","grader":"g","graded_at":"` + now + `","samples":[{"id":"s0","reward":0.25}]}]`,
			"grading anew samples whose earlier grading was of other content"},
		{"not json", `[{"rollout_id":"r1",`, "stored gradings do not decode; their samples will be graded again"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			state := openState(t, "")
			var sink logSink
			c := exactAnswer()
			cfg := grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g", State: state, Logger: sink.logger()}
			ts := startServer(t, "127.0.0.1:0", cfg)
			kv := gradingsBucket(t, state)
			if _, err := kv.Put(testContext(t), natsstore.Key("r1"), []byte(tc.value)); err != nil {
				t.Fatal(err)
			}
			client := stub(t, ts)
			wantGrade(t, "first request", grade(t, client, gradeReq(t, "r1", "6", "6")), 0, 1, false)
			wantGrade(t, "resend", grade(t, client, gradeReq(t, "r1", "6", "6")), 0, 1, true)
			if c.count() != 1 {
				t.Fatalf("grader ran %d times, want 1", c.count())
			}
			logged := false
			for _, r := range sink.records() {
				logged = logged || r.msg == tc.logged
			}
			if !logged {
				t.Errorf("no record %q", tc.logged)
			}

			ts.kill(t)
			c2 := exactAnswer()
			cfg.Graders, cfg.Logger = map[string]osmo.Grader{"g": c2}, nil
			client = stub(t, startServer(t, "127.0.0.1:0", cfg))
			wantGrade(t, "after restart", grade(t, client, gradeReq(t, "r1", "6", "6")), 0, 1, true)
			if c2.count() != 0 {
				t.Fatalf("the restarted service graded %d times", c2.count())
			}
			// The new grading replaced the value: one grading, with a
			// fingerprint and the new reward.
			if gs := storedGradings(t, kv, "r1"); len(gs) != 1 || len(gs[0].Samples) != 1 ||
				gs[0].Samples[0].Fingerprint == "" || gs[0].Samples[0].Reward == nil || *gs[0].Samples[0].Reward != 1 {
				t.Fatalf("stored %+v", gs)
			}
		})
	}
}

// The store keeps the latest grading of a sample only.
func TestStoreKeepsTheLatestGrading(t *testing.T) {
	rewardIsLabel := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		r, err := strconv.ParseFloat(*gc.Label, 64)
		if err != nil {
			return err
		}
		return gc.SetSampleReward("s0", r)
	})
	state := openState(t, "")
	cfg := grader.Config{Graders: map[string]osmo.Grader{"g": rewardIsLabel}, Default: "g", State: state}
	ts := startServer(t, "127.0.0.1:0", cfg)
	client := stub(t, ts)
	for _, label := range []string{"1", "0.5", "0.25"} {
		wantGrade(t, label, grade(t, client, gradeReq(t, "r1", label, "a")), 0, mustFloat(t, label), false)
	}
	if gs := storedGradings(t, gradingsBucket(t, state), "r1"); len(gs) != 1 || gs[0].Samples[0].Reward == nil || *gs[0].Samples[0].Reward != 0.25 {
		t.Fatalf("stored %+v", gs)
	}
	ts.kill(t)
	c2 := newCounter(nil)
	cfg.Graders = map[string]osmo.Grader{"g": c2}
	client = stub(t, startServer(t, "127.0.0.1:0", cfg))
	wantGrade(t, "latest after restart", grade(t, client, gradeReq(t, "r1", "0.25", "a")), 0, 0.25, true)
	if c2.count() != 0 {
		t.Fatalf("the restarted service graded %d times", c2.count())
	}
}

// Two requests for one sample id with different content that overlap never
// get each other's reward: the one that waits for the other's grading finds
// it is not its own and is graded in turn.
func TestConcurrentRequestsWithOtherContentGetTheirOwnReward(t *testing.T) {
	release := make(chan struct{})
	c := newCounter(func(_ context.Context, gc *osmo.GraderContext) error {
		if *gc.Label == "1" {
			<-release
		}
		r, err := strconv.ParseFloat(*gc.Label, 64)
		if err != nil {
			return err
		}
		return gc.SetSampleReward("s0", r)
	})
	rc := &recvUnary{}
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": c}, Default: "g"}, rc.option())
	client := stub(t, ts)
	ctx := testContext(t)

	labels := []string{"1", "0.5"}
	resps := make([]chan *graderv1.GradeResponse, len(labels))
	for i, label := range labels {
		resps[i] = make(chan *graderv1.GradeResponse, 1)
		go func() {
			resp, err := client.Grade(ctx, gradeReq(t, "r1", label, "a"))
			if err != nil {
				t.Error(err)
			}
			resps[i] <- resp
		}()
		if i == 0 {
			waitFor(t, "first grading", func() bool { return c.count() == 1 })
		}
	}
	waitFor(t, "both requests in", func() bool { return rc.calls.Load() == 2 })
	time.Sleep(50 * time.Millisecond) // let the second wait for the first's grading
	close(release)
	for i, label := range labels {
		select {
		case resp := <-resps[i]:
			wantGrade(t, "label "+label, resp, 0, mustFloat(t, label), false)
		case <-ctx.Done():
			t.Fatal("answers did not arrive")
		}
	}
	if c.count() != 2 {
		t.Fatalf("grader ran %d times, want 2", c.count())
	}
}

// The fingerprint covers exactly what a grader sees of a sample: changing
// any field of a RolloutSample (nested ones included) makes a request new
// if and only if it changes the sample the grader is given.
func TestFingerprintCoversWhatGradersSee(t *testing.T) {
	type view struct {
		Label    *string
		Metadata map[string]any
		Sample   *osmo.Sample
	}
	var mu sync.Mutex
	seen := map[string]view{}
	g := osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
		mu.Lock()
		seen[gc.RolloutID] = view{gc.Label, gc.Metadata, gc.Samples["s0"]}
		mu.Unlock()
		return gc.SetSampleReward("s0", 1)
	})
	ts := startServer(t, "127.0.0.1:0", grader.Config{Graders: map[string]osmo.Grader{"g": g}, Default: "g"})
	client := stub(t, ts)

	base := &rolloutv1.RolloutSample{}
	populate(base.ProtoReflect())
	base.Id, base.RolloutId = "s0", ""
	req := func(rid string, s *rolloutv1.RolloutSample) *graderv1.GradeRequest {
		return &graderv1.GradeRequest{RolloutId: rid, Samples: []*rolloutv1.RolloutSample{s}}
	}
	muts := mutations(base.ProtoReflect().Descriptor(), nil, "")
	if len(muts) < 40 {
		t.Fatalf("only %d mutations", len(muts))
	}
	for i, m := range muts {
		changed := proto.Clone(base).(*rolloutv1.RolloutSample)
		m.apply(changed.ProtoReflect())
		if proto.Equal(changed, base) {
			t.Fatalf("%s: the mutation changed nothing", m.name)
		}
		rid, fresh := fmt.Sprintf("r%d", i), fmt.Sprintf("fresh%d", i)
		grade(t, client, req(rid, base))
		grade(t, client, req(fresh, changed))
		mu.Lock()
		differs := !reflect.DeepEqual(seen[rid], seen[fresh])
		mu.Unlock()
		resp := grade(t, client, req(rid, changed))
		// A change graders do not see may still be graded again: the
		// fingerprint is of the sample as sent, which costs a grading,
		// never a reward for other content.
		if differs && resp.GetGrades()[0].GetCached() {
			t.Errorf("%s changes what the grader sees but was answered from the earlier grading", m.name)
		}
	}
}

// mutation changes one field somewhere in a RolloutSample.
type mutation struct {
	name  string
	apply func(root protoreflect.Message)
}

// mutations lists a change of every field of md's messages and of the
// messages they nest, reached from a root message through path (pairs of
// field and list index, -1 for a singular field). The id fields, the key,
// are left alone.
func mutations(md protoreflect.MessageDescriptor, path []step, prefix string) []mutation {
	var out []mutation
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		name := prefix + string(fd.Name())
		if len(path) == 0 && (fd.Name() == "id" || fd.Name() == "rollout_id") {
			continue
		}
		out = append(out, mutation{name: name, apply: func(root protoreflect.Message) { change(at(root, path), fd) }})
		if sub := fd.Message(); sub != nil && !wellKnown(sub) {
			idx := -1
			if fd.IsList() {
				idx = 0
				name += "[0]"
			}
			p := append(append([]step(nil), path...), step{fd, idx})
			out = append(out, mutations(sub, p, name+".")...)
		}
	}
	return out
}

type step struct {
	fd  protoreflect.FieldDescriptor
	idx int
}

func at(m protoreflect.Message, path []step) protoreflect.Message {
	for _, s := range path {
		if s.idx < 0 {
			m = m.Mutable(s.fd).Message()
		} else {
			m = m.Mutable(s.fd).List().Get(s.idx).Message()
		}
	}
	return m
}

func wellKnown(md protoreflect.MessageDescriptor) bool {
	return strings.HasPrefix(string(md.FullName()), "google.protobuf.")
}

// change gives field fd of m another value: one more element for a list, a
// different scalar, another well-known message, or no message at all.
func change(m protoreflect.Message, fd protoreflect.FieldDescriptor) {
	switch {
	case fd.IsList():
		l := m.Mutable(fd).List()
		switch {
		case fd.Message() != nil && wellKnown(fd.Message()):
			l.Append(protoreflect.ValueOfMessage(wellKnownMessage(fd.Message(), 1).ProtoReflect()))
		case fd.Message() != nil:
			e := l.NewElement()
			populate(e.Message())
			l.Append(e)
		default:
			l.Append(other(fd, protoreflect.Value{}))
		}
	case fd.Message() != nil && wellKnown(fd.Message()):
		m.Set(fd, protoreflect.ValueOfMessage(wellKnownMessage(fd.Message(), 1).ProtoReflect()))
	case fd.Message() != nil:
		m.Clear(fd)
	default:
		m.Set(fd, other(fd, m.Get(fd)))
	}
}

// populate sets every field of m, recursively, with lists of one element.
func populate(m protoreflect.Message) {
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := m.Mutable(fd).List()
			e := l.NewElement()
			if wellKnown(fd.Message()) {
				e = protoreflect.ValueOfMessage(wellKnownMessage(fd.Message(), 0).ProtoReflect())
			} else {
				populate(e.Message())
			}
			l.Append(e)
		case fd.IsList():
			m.Mutable(fd).List().Append(other(fd, protoreflect.Value{}))
		case fd.Message() != nil && wellKnown(fd.Message()):
			m.Set(fd, protoreflect.ValueOfMessage(wellKnownMessage(fd.Message(), 0).ProtoReflect()))
		case fd.Message() != nil:
			populate(m.Mutable(fd).Message())
		default:
			m.Set(fd, other(fd, m.Get(fd)))
		}
	}
}

// other is a value of fd's scalar kind different from v (any value when v
// is invalid).
func other(fd protoreflect.FieldDescriptor, v protoreflect.Value) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if !v.IsValid() {
			return protoreflect.ValueOfString("v")
		}
		return protoreflect.ValueOfString(v.String() + "x")
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(!v.IsValid() || !v.Bool())
	case protoreflect.DoubleKind:
		if !v.IsValid() {
			return protoreflect.ValueOfFloat64(0.5)
		}
		return protoreflect.ValueOfFloat64(v.Float() + 1)
	case protoreflect.Int32Kind:
		if !v.IsValid() {
			return protoreflect.ValueOfInt32(3)
		}
		return protoreflect.ValueOfInt32(int32(v.Int()) + 1)
	}
	panic(fmt.Sprintf("no other value for %s (%s): extend the test", fd.FullName(), fd.Kind()))
}

// wellKnownMessage is a value of a well-known message type; variants 0 and 1
// differ.
func wellKnownMessage(md protoreflect.MessageDescriptor, variant int) proto.Message {
	switch md.FullName() {
	case "google.protobuf.Struct":
		s, _ := structpb.NewStruct(map[string]any{"role": "assistant", "content": fmt.Sprint(6 + variant), "n": 1.0})
		return s
	case "google.protobuf.Timestamp":
		return timestamppb.New(time.Unix(1700000000+int64(variant), 0))
	}
	panic(fmt.Sprintf("no value for %s: extend the test", md.FullName()))
}

func mustFloat(t *testing.T, s string) float64 {
	t.Helper()
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatal(err)
	}
	return f
}
