package rollout

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// stuckKV holds the write that starts a rollout until released, then
// fails it and every later try as a NATS node that died under the write
// fails it: a timeout.
type stuckKV struct {
	jetstream.KeyValue
	entered  chan struct{}
	released chan struct{}
	once     sync.Once
}

func (kv *stuckKV) Update(ctx context.Context, key string, value []byte, last uint64) (uint64, error) {
	var lc lifecycle
	if json.Unmarshal(value, &lc) != nil || lc.Phase != phaseRunning {
		return kv.KeyValue.Update(ctx, key, value, last)
	}
	kv.once.Do(func() { close(kv.entered) })
	<-kv.released
	return 0, context.DeadlineExceeded
}

// answeredMsg is a delivery of a work message whose answers are counted.
type answeredMsg struct {
	jetstream.Msg
	mu      sync.Mutex
	answers []string
}

func (m *answeredMsg) answer(a string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.answers = append(m.answers, a)
	return nil
}

func (m *answeredMsg) Ack() error                       { return m.answer("ack") }
func (m *answeredMsg) DoubleAck(context.Context) error  { return m.answer("ack") }
func (m *answeredMsg) Nak() error                       { return m.answer("nak") }
func (m *answeredMsg) NakWithDelay(time.Duration) error { return m.answer("nak") }
func (m *answeredMsg) Term() error                      { return m.answer("term") }
func (m *answeredMsg) TermWithReason(string) error      { return m.answer("term") }
func (m *answeredMsg) InProgress() error                { return nil }

func (m *answeredMsg) got() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.answers...)
}

func (l *leases) holds(m jetstream.Msg) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.msgs[m]
	return ok
}

// TestRedeliveryDuringAFailedStart: the write that starts a rollout hangs
// (its NATS node died), the replica's hold on the work lapses meanwhile
// and the queue gives the rollout back to the same replica, which takes
// the new delivery into the rollout it is starting. The write then fails.
// The new delivery is the live one: it must be answered (sent back), not
// left held, where the replica's renewals would keep it from every
// replica for ever and the rollout would never run.
func TestRedeliveryDuringAFailedStart(t *testing.T) {
	// A state in files: not private, so the start is queued (a private
	// state's one replica starts it at once, see startsHere).
	st, err := natsstore.Open(t.Context(), natsstore.Config{Dir: t.TempDir(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	s, err := New(Config{AgentLoop: calculator.Loop{}, LostAfter: time.Second, State: st,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	kv := &stuckKV{KeyValue: s.sh.rollouts, entered: make(chan struct{}), released: make(chan struct{})}
	s.sh.rollouts = kv
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	msg, err := structpb.NewStruct(map[string]any{"role": "user", "content": "What is 6 * 7?"})
	if err != nil {
		t.Fatal(err)
	}
	// Not served: the test takes the work from the queue itself.
	if _, err := s.StartRollout(ctx, &rolloutv1.StartRolloutRequest{
		RolloutId: "stuck-start", InitialMessages: []*structpb.Struct{msg},
		ChatCompletionsUrl: "http://127.0.0.1:9/v1", CompletionCallbackUrl: "http://127.0.0.1:9/completion",
	}); err != nil {
		t.Fatal(err)
	}
	batch, err := s.sh.work.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var first jetstream.Msg
	for m := range batch.Messages() {
		first = m
	}
	if first == nil {
		t.Fatalf("no work in the queue: %v", batch.Error())
	}
	firstDelivery := &answeredMsg{Msg: first}
	began := make(chan struct{})
	go func() {
		defer close(began)
		s.take(firstDelivery, func() {}, false)
	}()
	select {
	case <-kv.entered:
	case <-ctx.Done():
		t.Fatal("the write that starts the rollout was never made")
	}

	// The queue gives the rollout back while the write hangs.
	again := &answeredMsg{Msg: first}
	s.take(again, func() {}, false)
	rec := s.store.get("stuck-start")
	if rec == nil {
		t.Fatal("the rollout being started is not held")
	}
	rec.mu.Lock()
	taken := rec.work == jetstream.Msg(again)
	rec.mu.Unlock()
	if !taken {
		t.Fatal("the redelivery was not taken into the rollout being started: the test did not test anything")
	}

	close(kv.released)
	select {
	case <-began:
	case <-ctx.Done():
		t.Fatal("the failed start did not return")
	}
	if s.leases.holds(again) {
		t.Error("the live delivery is still held after the start failed: renewed for ever, the rollout never runs")
	}
	if got := again.got(); len(got) != 1 || got[0] != "nak" {
		t.Errorf("the live delivery was answered %v, want one nak (back to the queue)", got)
	}
	if s.store.get("stuck-start") != nil {
		t.Error("the rollout whose start failed is still held")
	}

	// A delivery that reaches a record already let go of is sent back,
	// not taken on.
	late := &answeredMsg{Msg: first}
	rec.mu.Lock()
	rec.work = nil
	rec.mu.Unlock()
	s.store.add(rec)
	s.take(late, func() {}, false)
	s.store.remove(rec)
	if s.leases.holds(late) {
		t.Error("a delivery taken into a record already let go of is held")
	}
	if got := late.got(); len(got) != 1 || got[0] != "nak" {
		t.Errorf("a delivery reaching a record already let go of was answered %v, want one nak", got)
	}
}

// renewedMsg is a held delivery whose renewal fails with err.
type renewedMsg struct {
	jetstream.Msg
	err error
}

func (m renewedMsg) InProgress() error { return m.err }

// TestRenewSkipsAnsweredMessages: a message answered between the listing
// of the held ones and its renewal (a rollout that just finished) is not a
// failed renewal; one the server could not renew is.
func TestRenewSkipsAnsweredMessages(t *testing.T) {
	for _, tc := range []struct {
		err  error
		warn bool
	}{
		{jetstream.ErrMsgAlreadyAckd, false},
		{nats.ErrConnectionClosed, true},
	} {
		var buf logtest.Buffer
		l := &leases{msgs: map[jetstream.Msg]struct{}{&renewedMsg{err: tc.err}: {}}}
		ctx, cancel := context.WithTimeout(context.Background(), 120*time.Millisecond)
		l.renew(ctx, 20*time.Millisecond, slog.New(slog.NewJSONHandler(&buf, nil)))
		cancel()
		warned := strings.Contains(buf.String(), "could not renew")
		if warned != tc.warn {
			t.Errorf("renewal failing with %v: warned %v, want %v; log:\n%s", tc.err, warned, tc.warn, buf.String())
		}
	}
}

// hungKV is a shared state whose lifecycle writes never answer: each waits
// until its caller gives up, as a write to a NATS leader that died does.
type hungKV struct {
	jetstream.KeyValue
}

func (kv hungKV) Update(ctx context.Context, _ string, _ []byte, _ uint64) (uint64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

// TestAdmissionAnswersInTime: a G1 init whose shared state stops answering
// after the rollout was entered is refused within the admission's time,
// which the trainer retries, rather than held for as long as each step
// takes to give up.
func TestAdmissionAnswersInTime(t *testing.T) {
	s := newCalculatorService(t)
	s.admitWithin = 500 * time.Millisecond
	s.sh.rollouts = hungKV{s.sh.rollouts}
	msg, err := structpb.NewStruct(map[string]any{"role": "user", "content": "What is 6 * 7?"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	began := time.Now()
	_, err = s.InitRollout(ctx, &rolloutv1.InitRolloutRequest{RolloutId: "hung-init", ServerUrl: "http://127.0.0.1:9",
		Messages: []*structpb.Struct{msg}, CompletionParams: &structpb.Struct{}})
	took := time.Since(began)
	if code := status.Code(err); code != codes.Unavailable && code != codes.DeadlineExceeded {
		t.Fatalf("init with the state hung: %v, want Unavailable or DeadlineExceeded", err)
	}
	if took > 5*time.Second {
		t.Errorf("init with the state hung answered after %v, want about its admission time (%v)", took, s.admitWithin)
	}
}
