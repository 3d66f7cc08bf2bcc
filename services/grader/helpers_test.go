package grader_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/services/grader"
)

// testTimeout bounds every wait in these tests.
const testTimeout = 20 * time.Second

func testContext(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// testServer is a grader Service behind a real gRPC server on loopback.
type testServer struct {
	svc  *grader.Service
	gs   *grpc.Server
	addr string
	done chan struct{}
	once sync.Once
}

// openState opens a NATS store for gradings: embedded, in memory, or on
// disk under dir when dir is set. It is closed at cleanup.
func openState(t testing.TB, dir string) *natsstore.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{Dir: dir, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// gradingsBucket is the bucket in which the services on st keep their
// gradings (one of them must have been built).
func gradingsBucket(t testing.TB, st *natsstore.Store) jetstream.KeyValue {
	t.Helper()
	kv, err := st.JS.KeyValue(testContext(t), grader.BucketName)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// storedGrading is a grading as the bucket holds it.
type storedGrading struct {
	RolloutID string    `json:"rollout_id"`
	GradedAt  time.Time `json:"graded_at"`
	Error     string    `json:"error"`
	Samples   []struct {
		ID          string   `json:"id"`
		Reward      *float64 `json:"reward"`
		Fingerprint string   `json:"fingerprint"`
	} `json:"samples"`
}

// storedGradings reads rollout rid's gradings out of the bucket (none when
// it has no key).
func storedGradings(t testing.TB, kv jetstream.KeyValue, rid string) []storedGrading {
	t.Helper()
	e, err := kv.Get(testContext(t), natsstore.Key(rid))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var gs []storedGrading
	if err := json.Unmarshal(e.Value(), &gs); err != nil {
		t.Fatalf("stored gradings of %s: %v: %s", rid, err, e.Value())
	}
	return gs
}

// startServer listens on addr ("127.0.0.1:0" for any port) and serves a
// Service built from cfg, on a store of its own unless cfg.State is set.
// It is killed at cleanup.
func startServer(t testing.TB, addr string, cfg grader.Config, opts ...grpc.ServerOption) *testServer {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	if cfg.State == nil {
		cfg.State = openState(t, "")
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	svc, err := grader.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		svc.Close()
		t.Fatal(err)
	}
	ts := &testServer{svc: svc, gs: grpc.NewServer(opts...), addr: ln.Addr().String(), done: make(chan struct{})}
	graderv1.RegisterGraderServiceServer(ts.gs, svc)
	go func() {
		defer close(ts.done)
		_ = ts.gs.Serve(ln)
	}()
	t.Cleanup(func() { ts.kill(t) })
	return ts
}

// kill stops the server hard, as a crash would (connections cut, no
// draining), and then closes the Service.
func (ts *testServer) kill(t testing.TB) {
	ts.once.Do(func() {
		ts.gs.Stop()
		<-ts.done
		if err := ts.svc.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
}

func dial(t testing.TB, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func stub(t *testing.T, ts *testServer) graderv1.GraderServiceClient {
	return graderv1.NewGraderServiceClient(dial(t, ts.addr))
}

// gradeReq builds a request for rollout rid whose sample i answers answers[i].
func gradeReq(t testing.TB, rid, label string, answers ...string) *graderv1.GradeRequest {
	t.Helper()
	req := &graderv1.GradeRequest{RolloutId: rid, Label: &label}
	for i, a := range answers {
		user, err := structpb.NewStruct(map[string]any{"role": "user", "content": "question"})
		if err != nil {
			t.Fatal(err)
		}
		asst, err := structpb.NewStruct(map[string]any{"role": "assistant", "content": a})
		if err != nil {
			t.Fatal(err)
		}
		req.Samples = append(req.Samples, &rolloutv1.RolloutSample{
			RolloutId: rid,
			Id:        fmt.Sprintf("s%d", i),
			Messages:  []*structpb.Struct{user, asst},
		})
	}
	return req
}

// counter is a grader that counts the samples it grades and delegates the
// scoring to fn (every sample gets 1 when fn is nil).
type counter struct {
	mu      sync.Mutex
	runs    int
	samples map[string]int // "rollout/sample" -> times graded
	fn      func(ctx context.Context, gc *osmo.GraderContext) error
}

func newCounter(fn func(ctx context.Context, gc *osmo.GraderContext) error) *counter {
	return &counter{samples: map[string]int{}, fn: fn}
}

func (c *counter) Grade(ctx context.Context, gc *osmo.GraderContext) error {
	c.mu.Lock()
	c.runs++
	for id := range gc.Samples {
		c.samples[gc.RolloutID+"/"+id]++
	}
	c.mu.Unlock()
	if c.fn != nil {
		return c.fn(ctx, gc)
	}
	for id := range gc.Samples {
		if err := gc.SetSampleReward(id, 1); err != nil {
			return err
		}
	}
	return nil
}

func (c *counter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs
}

func (c *counter) graded(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.samples[key]
}

// logSink records every log record with the attributes it carries.
type logSink struct {
	mu   sync.Mutex
	recs []logRecord
}

type logRecord struct {
	msg   string
	attrs map[string]any
}

func (s *logSink) logger() *slog.Logger { return slog.New(&captureHandler{sink: s}) }

func (s *logSink) records() []logRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.recs)
}

type captureHandler struct {
	sink  *logSink
	attrs []slog.Attr
}

func (h *captureHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *captureHandler) Handle(_ context.Context, r slog.Record) error {
	m := map[string]any{}
	for _, a := range h.attrs {
		m[a.Key] = a.Value.Any()
	}
	r.Attrs(func(a slog.Attr) bool {
		m[a.Key] = a.Value.Any()
		return true
	})
	h.sink.mu.Lock()
	h.sink.recs = append(h.sink.recs, logRecord{msg: r.Message, attrs: m})
	h.sink.mu.Unlock()
	return nil
}

func (h *captureHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &captureHandler{sink: h.sink, attrs: append(slices.Clip(h.attrs), as...)}
}

func (h *captureHandler) WithGroup(string) slog.Handler { return h }

// waitFor polls cond until it holds or the test's time is up.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// recvCounter is a stream interceptor counting streams opened and requests
// received.
type recvCounter struct {
	streams  atomic.Int64
	requests atomic.Int64
}

func (rc *recvCounter) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	rc.streams.Add(1)
	return handler(srv, &countingStream{ServerStream: ss, rc: rc})
}

type countingStream struct {
	grpc.ServerStream
	rc *recvCounter
}

func (s *countingStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	if err == nil {
		s.rc.requests.Add(1)
	}
	return err
}

var errBoom = errors.New("boom")

// recvUnary counts unary calls that reached the server.
type recvUnary struct{ calls atomic.Int64 }

func (r *recvUnary) option() grpc.ServerOption {
	return grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		r.calls.Add(1)
		return handler(ctx, req)
	})
}
