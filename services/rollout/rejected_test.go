package rollout_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/services/rollout"
)

// callbackSink records every POST it gets, by path, and answers 200 {}
// unless told otherwise for a path.
type callbackSink struct {
	srv *httptest.Server

	mu    sync.Mutex
	posts map[string][]sinkPost
	// answers are statuses to give a path's first posts, in order.
	answers map[string][]int
	// hold, when set for a path, is waited on before answering.
	hold    map[string]chan struct{}
	changed chan struct{}
}

type sinkPost struct {
	header http.Header
	body   []byte
	status int
}

func newCallbackSink(t *testing.T) *callbackSink {
	t.Helper()
	s := &callbackSink{posts: map[string][]sinkPost{}, answers: map[string][]int{}, hold: map[string]chan struct{}{}, changed: make(chan struct{})}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		hold := s.hold[r.URL.Path]
		s.mu.Unlock()
		if hold != nil {
			select {
			case <-hold:
			case <-r.Context().Done():
				return
			}
		}
		s.mu.Lock()
		code := http.StatusOK
		if q := s.answers[r.URL.Path]; len(q) > 0 {
			code, s.answers[r.URL.Path] = q[0], q[1:]
		}
		s.posts[r.URL.Path] = append(s.posts[r.URL.Path], sinkPost{header: r.Header.Clone(), body: body, status: code})
		close(s.changed)
		s.changed = make(chan struct{})
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = w.Write([]byte(`{}`))
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *callbackSink) url(path string) string { return s.srv.URL + path }

// got returns the posts path received so far.
func (s *callbackSink) got(path string) []sinkPost {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]sinkPost(nil), s.posts[path]...)
}

func (s *callbackSink) total() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.posts {
		n += len(p)
	}
	return n
}

// wait blocks until path received n posts (failing after 8s) and returns
// them.
func (s *callbackSink) wait(t *testing.T, path string, n int) []sinkPost {
	t.Helper()
	deadline := time.After(8 * time.Second)
	for {
		s.mu.Lock()
		got, changed := append([]sinkPost(nil), s.posts[path]...), s.changed
		s.mu.Unlock()
		if len(got) >= n {
			return got
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("%s: %d posts after 8s, want %d", path, len(got), n)
		}
	}
}

// settle gives callbacks that should not come time to arrive.
func settle() { time.Sleep(150 * time.Millisecond) }

// checkRejection checks that post is the G2 failure for a refused start.
func checkRejection(t *testing.T, what string, post sinkPost, id, msg string, grader bool, bearer string) {
	t.Helper()
	var got map[string]any
	if err := json.Unmarshal(post.body, &got); err != nil {
		t.Fatalf("%s: body %s: %v", what, post.body, err)
	}
	want := map[string]any{"status": "failure", "rollout_id": id, "err_message": msg, "err_category": "validation_error"}
	if grader {
		want["samples"], want["sample"] = map[string]any{}, nil
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s: body %s\nwant %v", what, post.body, want)
	}
	wantAuth := ""
	if bearer != "" {
		wantAuth = "Bearer " + bearer
	}
	if a := post.header.Get("Authorization"); a != wantAuth {
		t.Errorf("%s: Authorization %q, want %q", what, a, wantAuth)
	}
}

// TestG2RejectedStartCallbacks: a start refused as bad input answers
// InvalidArgument (422 over REST) naming the field, and also ends, for a
// controller that only watches its callbacks, in one completion and one
// grader callback reporting a validation_error failure with the same
// message.
func TestG2RejectedStartCallbacks(t *testing.T) {
	sink := newCallbackSink(t)
	h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil)})
	type rejected struct {
		name, id, field, bearer string
		msg                     string
	}
	var sent []rejected
	for _, tc := range []struct {
		name  string
		edit  func(*rolloutv1.StartRolloutRequest)
		field string
		// keyNotSent: the key was the refused field and cannot be a
		// header value; the callbacks go without it.
		keyNotSent bool
	}{
		{"blank-id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "  " }, "rollout_id", false},
		{"empty-id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "" }, "rollout_id", false},
		{"slash-id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "a/b" }, "rollout_id", false},
		{"dotdot-id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = ".." }, "rollout_id", false},
		{"empty-key", func(r *rolloutv1.StartRolloutRequest) { r.ControllerApiKey = proto.String("") }, "controller_api_key", false},
		{"newline-key", func(r *rolloutv1.StartRolloutRequest) { r.ControllerApiKey = proto.String("k\r\nX-Injected: 1") }, "controller_api_key", true},
		{"negative-agent-timeout", func(r *rolloutv1.StartRolloutRequest) { r.AgentTimeoutSec = proto.Float64(-1) }, "agent_timeout_sec", false},
		{"negative-grader-timeout", func(r *rolloutv1.StartRolloutRequest) { r.GraderTimeoutSec = proto.Float64(-3) }, "grader_timeout_sec", false},
	} {
		req := h.startReq(t, "rej-"+tc.name)
		req.CompletionCallbackUrl = sink.url("/c/" + tc.name)
		req.GraderCallbackUrl = proto.String(sink.url("/g/" + tc.name))
		tc.edit(req)
		_, err := h.client.StartRollout(context.Background(), req)
		st := status.Convert(err)
		if st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), tc.field+":") {
			t.Fatalf("%s: got %v, want InvalidArgument naming %s", tc.name, err, tc.field)
		}
		bearer := req.GetControllerApiKey()
		if tc.keyNotSent {
			bearer = ""
		}
		sent = append(sent, rejected{name: tc.name, id: req.GetRolloutId(), field: tc.field, bearer: bearer, msg: st.Message()})
	}
	for _, r := range sent {
		checkRejection(t, r.name+" completion", sink.wait(t, "/c/"+r.name, 1)[0], r.id, r.msg, false, r.bearer)
		checkRejection(t, r.name+" grader callback", sink.wait(t, "/g/"+r.name, 1)[0], r.id, r.msg, true, r.bearer)
	}
	settle()
	for _, r := range sent {
		if n, m := len(sink.got("/c/"+r.name)), len(sink.got("/g/"+r.name)); n != 1 || m != 1 {
			t.Errorf("%s: %d completions and %d grader callbacks, want 1 each", r.name, n, m)
		}
	}
	// Nothing ran, nothing was kept.
	if n := len(h.g2.Chats()); n != 0 {
		t.Errorf("refused starts made %d LLM calls", n)
	}
	if hr := h.health(t); hr.GetActiveRollouts() != 0 || hr.GetCompletedRollouts() != 0 || hr.GetConcurrency().GetQueued() != 0 {
		t.Errorf("health after refused starts = %v", hr)
	}
	if st := h.status(t, "rej-empty-key"); st.GetStatus() != "unknown" {
		t.Errorf("a refused start left a rollout: %v", st)
	}
}

// TestG2RejectedStartCallbackRules covers when a refused start's callbacks
// are and are not posted.
func TestG2RejectedStartCallbackRules(t *testing.T) {
	badTimeout := func(r *rolloutv1.StartRolloutRequest) { r.AgentTimeoutSec = proto.Float64(-1) }

	t.Run("only to usable URLs", func(t *testing.T) {
		sink := newCallbackSink(t)
		h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil)})
		for _, tc := range []struct {
			name, completion string
			grader           *string
			wantC, wantG     bool
		}{
			{"ftp completion url", "ftp://" + strings.TrimPrefix(sink.url("/c/ftp"), "http://"), proto.String(sink.url("/g/ftp")), false, true},
			{"empty grader url", sink.url("/c/empty-grader"), proto.String(""), true, false},
			{"no grader url", sink.url("/c/no-grader"), nil, true, false},
			{"relative urls", "/c/relative", proto.String("/g/relative"), false, false},
		} {
			req := h.startReq(t, "rules-1")
			req.CompletionCallbackUrl, req.GraderCallbackUrl = tc.completion, tc.grader
			badTimeout(req)
			if _, err := h.client.StartRollout(context.Background(), req); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%s: %v, want InvalidArgument", tc.name, err)
			}
		}
		sink.wait(t, "/g/ftp", 1)
		sink.wait(t, "/c/empty-grader", 1)
		sink.wait(t, "/c/no-grader", 1)
		settle()
		if n := sink.total(); n != 3 {
			t.Errorf("%d callbacks posted, want the 3 to usable URLs", n)
		}
	})

	t.Run("the answer does not wait for the callbacks", func(t *testing.T) {
		sink := newCallbackSink(t)
		release := make(chan struct{})
		sink.hold["/c/slow"] = release
		h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil)})
		req := h.startReq(t, "slow-1")
		req.CompletionCallbackUrl, req.GraderCallbackUrl = sink.url("/c/slow"), nil
		badTimeout(req)
		start := time.Now()
		_, err := h.client.StartRollout(context.Background(), req)
		if status.Code(err) != codes.InvalidArgument || time.Since(start) > time.Second {
			t.Fatalf("answer %v after %s, want InvalidArgument at once", err, time.Since(start))
		}
		close(release)
		sink.wait(t, "/c/slow", 1)
	})

	t.Run("retried under the G2 policy", func(t *testing.T) {
		sink := newCallbackSink(t)
		sink.answers["/c/retry"] = []int{503, 503}
		sink.answers["/g/retry"] = []int{400}
		h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil)})
		req := h.startReq(t, "retry-1")
		req.CompletionCallbackUrl, req.GraderCallbackUrl = sink.url("/c/retry"), proto.String(sink.url("/g/retry"))
		badTimeout(req)
		if _, err := h.client.StartRollout(context.Background(), req); status.Code(err) != codes.InvalidArgument {
			t.Fatal(err)
		}
		// 503 is retried until delivered; a 4xx is not retried.
		if got := sink.wait(t, "/c/retry", 3); got[2].status != 200 {
			t.Errorf("completion attempts %v", got)
		}
		sink.wait(t, "/g/retry", 1)
		settle()
		if n, m := len(sink.got("/c/retry")), len(sink.got("/g/retry")); n != 3 || m != 1 {
			t.Errorf("%d completion and %d grader attempts, want 3 and 1", n, m)
		}
	})

	t.Run("not for an unauthenticated caller", func(t *testing.T) {
		sink := newCallbackSink(t)
		h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil), cfg: func(c *rollout.Config) { c.APIKey = "server-key" }})
		req := h.startReq(t, "auth-1")
		req.CompletionCallbackUrl, req.GraderCallbackUrl = sink.url("/c/noauth"), proto.String(sink.url("/g/noauth"))
		badTimeout(req)
		if _, err := h.client.StartRollout(context.Background(), req); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("without the key: %v, want Unauthenticated", err)
		}
		wrong := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer not-it")
		if _, err := h.client.StartRollout(wrong, req); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("with a wrong key: %v, want Unauthenticated", err)
		}
		// Called directly, without the interceptor: still nothing posted.
		if _, err := h.svc.StartRollout(context.Background(), req); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("direct call: %v, want InvalidArgument", err)
		}
		settle()
		if n := sink.total(); n != 0 {
			t.Fatalf("%d callbacks posted for unauthenticated starts", n)
		}
		// With the key, the refusal is reported.
		req.CompletionCallbackUrl, req.GraderCallbackUrl = sink.url("/c/auth"), proto.String(sink.url("/g/auth"))
		ok := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer server-key")
		if _, err := h.client.StartRollout(ok, req); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("with the key: %v, want InvalidArgument", err)
		}
		sink.wait(t, "/c/auth", 1)
		sink.wait(t, "/g/auth", 1)
	})

	t.Run("not at capacity, nor for a rollout held here", func(t *testing.T) {
		sink := newCallbackSink(t)
		b := newBlockingWorkflow()
		h := newHarness(t, harnessOpts{wf: b.workflow(t), cfg: func(c *rollout.Config) { c.MaxConcurrent, c.MaxQueued = 1, 1 }})
		h.start(t, h.startReq(t, "held"))
		b.waitStarted(t, "held")
		h.start(t, h.startReq(t, "queued"))
		h.waitHealth(t, "1 queued", func(c *rolloutv1.Concurrency) bool { return c.GetQueued() == 1 })

		full := h.startReq(t, "full")
		full.CompletionCallbackUrl, full.GraderCallbackUrl = sink.url("/c/full"), proto.String(sink.url("/g/full"))
		if _, err := h.client.StartRollout(context.Background(), full); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("at capacity: %v, want ResourceExhausted", err)
		}
		// The running rollout's id with a bad field: refused, but the
		// callbacks of "held" are its own.
		again := h.startReq(t, "held")
		again.CompletionCallbackUrl, again.GraderCallbackUrl = sink.url("/c/held"), proto.String(sink.url("/g/held"))
		badTimeout(again)
		if _, err := h.client.StartRollout(context.Background(), again); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("bad start under a running id: %v, want InvalidArgument", err)
		}
		settle()
		if n := sink.total(); n != 0 {
			t.Fatalf("%d callbacks posted for a start refused at capacity or under a held id", n)
		}
		if _, err := h.client.CancelRollouts(context.Background(), &rolloutv1.CancelRolloutsRequest{All: true}); err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{"held", "queued"} {
			h.waitDone(t, id)
			if n := len(h.g2.Completions(id)); n != 1 || h.g2.Completions(id)[0].Status != "cancelled" {
				t.Errorf("%s: completions %v, want its one cancelled", id, h.g2.Completions(id))
			}
		}
	})
}
