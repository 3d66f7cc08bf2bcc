package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// takeWork takes rollouts from the shared queue while this replica has
// free slots, until ctx ends: what waits, waits where every replica can
// take it.
func (s *Service) takeWork(ctx context.Context) {
	for ctx.Err() == nil {
		release, err := s.acquire(ctx)
		if err != nil {
			return
		}
		releases := []func(){release}
		for len(releases) < fetchBatch {
			r, ok := s.tryAcquire()
			if !ok {
				break
			}
			releases = append(releases, r)
		}
		batch, err := s.sh.work.Fetch(len(releases), jetstream.FetchMaxWait(time.Second))
		n := 0
		if err == nil {
			for msg := range batch.Messages() {
				r := releases[n]
				n++
				s.wg.Go(func() { s.take(msg, r, false) })
			}
			err = batch.Error()
		}
		for _, r := range releases[n:] {
			r()
		}
		if err != nil && !errors.Is(err, jetstream.ErrNoMessages) && ctx.Err() == nil {
			s.log.Warn("shared state: could not take work from the queue", "error", err)
			sleepCtx(ctx, time.Second)
		}
	}
}

// serveConsumer handles each message of c in a goroutine of its own, at
// most limit at once, until ctx ends. Each message is held from its
// arrival, so one waiting for its turn is not given to another replica.
func (s *Service) serveConsumer(ctx context.Context, c jetstream.Consumer, limit int, handle func(jetstream.Msg)) {
	slots := make(chan struct{}, limit)
	for ctx.Err() == nil {
		// A heartbeat each second: a pull lost with the consumer's leader
		// is noticed within two, not the client's default of thirty.
		it, err := c.Messages(jetstream.PullMaxMessages(limit), jetstream.PullExpiry(pullExpiry), jetstream.PullHeartbeat(pullHeartbeat))
		if err != nil {
			s.log.Warn("shared state: could not pull from the queue", "consumer", c.CachedInfo().Name, "error", err)
			sleepCtx(ctx, time.Second)
			continue
		}
		stop := context.AfterFunc(ctx, it.Stop)
		for {
			msg, err := it.Next()
			if err != nil {
				if ctx.Err() == nil && !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
					s.log.Warn("shared state: pulling from the queue failed", "consumer", c.CachedInfo().Name, "error", err)
					sleepCtx(ctx, time.Second)
				}
				break
			}
			s.leases.hold(msg)
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				// Not taken: back to the queue for another replica.
				s.leases.drop(msg)
				_ = msg.Nak()
				continue
			}
			s.wg.Go(func() {
				defer func() { <-slots }()
				defer s.leases.drop(msg)
				handle(msg)
			})
		}
		it.Stop()
		stop()
	}
}

// A continuous pull is renewed every pullExpiry and heartbeats every
// pullHeartbeat.
const (
	pullExpiry    = 5 * time.Second
	pullHeartbeat = time.Second
)

// fetchBatch is the most rollouts taken from the queue at once.
const fetchBatch = 32

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// take handles one rollout from the queue, in a slot (release gives it
// back): a queued one runs here; a lost replica's is concluded from its
// lifecycle. control says the message came from the control queue: a
// rollout cancelled while queued, concluded without a slot.
func (s *Service) take(msg jetstream.Msg, release func(), control bool) {
	ctx, cancel := context.WithTimeout(s.deliverCtx, 10*time.Second)
	defer cancel()
	prefix := subjectQueued
	if control {
		prefix = subjectControl
	}
	id, err := idOfSubject(msg.Subject(), prefix)
	if err != nil {
		s.log.Error("shared state: a work message names no rollout; dropped", "subject", msg.Subject())
		_ = msg.Term()
		release()
		return
	}
	meta, metaErr := msg.Metadata()
	lc, err := s.sh.queuedLifecycle(ctx, id, metaErr == nil && meta.NumDelivered == 1)
	switch {
	case errors.Is(err, errGone):
		_ = msg.Ack()
		release()
		return
	case err != nil:
		s.log.Warn("shared state: could not read a rollout taken from the queue; it goes back", "rollout_id", id, "error", err)
		_ = msg.NakWithDelay(time.Second)
		release()
		return
	}
	// The message that holds the rollout is known by its stream sequence:
	// its redelivery means its holder was lost; any other is stale.
	queue := "?"
	if metaErr == nil {
		queue = strconv.FormatUint(meta.Sequence.Stream, 10)
	}
	if lc.Phase != phaseQueued && lc.Held != queue {
		_ = msg.Ack()
		release()
		return
	}
	if held := s.store.get(id); held != nil {
		// This replica's own hold lapsed and the queue gave the rollout
		// back: it runs on under the new delivery, unless its work was let
		// go of meanwhile (then the delivery goes back). Under the record's
		// lock, so a release that follows lets go of the new delivery.
		release()
		held.mu.Lock()
		old := held.work
		if old == nil {
			held.mu.Unlock()
			_ = msg.NakWithDelay(time.Second)
			return
		}
		s.leases.hold(msg)
		held.work = msg
		held.mu.Unlock()
		s.leases.drop(old)
		return
	}
	switch lc.Phase {
	case phaseQueued:
		s.begin(ctx, lc, msg, queue, release)
	case phaseFinished, phaseAdmitting:
		_ = msg.Ack()
		release()
	default:
		release()
		s.resume(lc, msg)
	}
}

// begin runs a queued rollout here: its record is rebuilt and stored here
// first (so a cancel reaching this replica finds it), then the lifecycle
// says this replica runs it; one cancelled while queued concludes without
// running. msg is the work message holding it, nil from a private queue
// (queue is then ""); again says a start the state could not write should
// be retried (a message goes back by itself).
func (s *Service) begin(ctx context.Context, lc *lifecycle, msg jetstream.Msg, queue string, release func()) (again bool) {
	rec, err := s.restore(lc)
	if err != nil {
		s.log.Error("shared state: a queued rollout could not be rebuilt; it is dropped", "rollout_id", lc.ID, "error", err)
		if msg != nil {
			_ = msg.Term()
		}
		release()
		return false
	}
	if msg != nil {
		rec.work = msg
		s.leases.hold(msg)
	}
	s.store.add(rec)
	// The span starts under the admitting request's trace; the lifecycle
	// then carries it, for whoever delivers the callbacks.
	s.traceRollout(s.traceCtx(context.Background(), lc), rec)
	var carrier map[string]string
	if s.tracer != nil {
		carrier = map[string]string{}
		s.cfg.Propagator.Inject(rec.traced(context.Background()), propagation.MapCarrier(carrier))
	}
	// A try whose answer was lost may have written already.
	stored, err := s.persist(ctx, lc.ID, func(lc *lifecycle) error {
		if lc.Phase == phaseRunning && lc.Owner == s.replica && lc.Held == queue {
			return errUnchanged
		}
		if lc.Phase != phaseQueued {
			return errNotOwner
		}
		lc.Owner, lc.Held, lc.Phase, lc.State, lc.Started = s.replica, queue, phaseRunning, rolloutv1.State_STATE_RUNNING, time.Now()
		lc.admitted = nil // the record holds it now
		if carrier != nil {
			lc.Trace = carrier
		}
		return nil
	})
	if errors.Is(err, errUnchanged) {
		err = nil
	}
	if err != nil {
		release()
		s.store.remove(rec)
		// The queue may have given the rollout back meanwhile and take put
		// that delivery in the record: it is the live one to answer.
		if msg != nil {
			s.leases.drop(msg)
		}
		if live := s.detachWork(rec); live != nil {
			msg = live
		}
		rec.rolloutSpan().End()
		if errors.Is(err, errNotOwner) || errors.Is(err, errGone) {
			if msg != nil {
				_ = msg.Ack()
			}
			return false
		}
		s.log.Warn("shared state: could not start a queued rollout; it goes back", "rollout_id", lc.ID, "error", err)
		if msg != nil {
			_ = msg.NakWithDelay(time.Second)
		}
		return true
	}
	if stored.Cancelled {
		rec.cancel()
	}
	s.process(rec, release)
	return false
}

// resume concludes a lost replica's rollout from the stage it reached.
func (s *Service) resume(lc *lifecycle, msg jetstream.Msg) {
	log := s.log.With("rollout_id", lc.ID, "wire", lc.Wire)
	rec, err := s.restore(lc)
	if err != nil {
		log.Error("shared state: a rollout of a lost replica could not be rebuilt; it is dropped", "error", err)
		_ = msg.Term()
		return
	}
	lost := lc.Owner
	// A lost replica that comes back finds the rollout is not its own.
	stored, err := s.sh.update(s.deliverCtx, lc.ID, func(cur *lifecycle) error {
		if cur.Phase == phaseFinished || cur.Owner != lost {
			return errUnchanged
		}
		cur.Owner = s.replica
		return nil
	})
	if err != nil {
		if errors.Is(err, errUnchanged) {
			_ = msg.Ack()
		} else {
			log.Warn("shared state: could not take over a rollout of a lost replica; it goes back", "error", err)
			_ = msg.NakWithDelay(time.Second)
		}
		return
	}
	stored = stored.clone()
	stored.Owner = lost
	rec.work = msg
	s.leases.hold(msg)
	s.store.add(rec)
	s.traceRollout(s.traceCtx(context.Background(), lc), rec)
	how := recoveredRedelivered
	run := outcome.Failed(outcome.Agent, "%s", s.lostMessage(stored, "while the rollout was running"))
	if stored.Ran != nil {
		run = stored.Ran.Outcome.outcome()
	}
	if stored.Final == nil {
		how = recoveredInterrupted
	}
	s.metrics.recovered.WithLabelValues(how).Inc()
	log.Warn("concluding a rollout whose replica was lost", "lost", lost, "phase", stored.Phase, "resumed_as", how)
	rec.settle(run)
	s.conclude(rec, run, stored, log)
}

// redeliver makes one attempt at a callback from the outbox: done with, it
// is marked and acknowledged; failed transiently, it goes back with the
// wire's backoff until the delivery deadline; stopped by the shutdown, it
// goes back at once.
func (s *Service) redeliver(ctx context.Context, msg jetstream.Msg) {
	var m outboxMsg
	if err := json.Unmarshal(msg.Data(), &m); err != nil {
		s.log.Error("shared state: an outbox message could not be read; dropped", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		return
	}
	log := s.log.With("rollout_id", m.ID, "stage", m.Stage, "index", m.Index)
	lc, _, err := s.sh.get(ctx, m.ID)
	switch {
	case errors.Is(err, errGone):
		log.Debug("outbox: the rollout is gone; dropped")
		_ = msg.Ack()
		return
	case err != nil:
		log.Debug("outbox: could not read the rollout; later", "error", err)
		_ = msg.NakWithDelay(time.Second)
		return
	}
	st := lc.stage(m.Stage)
	if st == nil || m.Index >= len(st.Done) || m.Index >= len(st.Callbacks) || st.Done[m.Index] {
		log.Debug("outbox: the callback is done with", "phase", lc.Phase)
		// The mark may have let the final stage go with a replica that died
		// before handing it over: handed over again.
		if m.Stage == stageRan && lc.Final != nil && lc.Final.Sending && !lc.Final.done() &&
			!s.send(ctx, nil, m.ID, lc.Created, s.policyOf(lc.Wire), stageFinal, lc.Final, false, nil, log) {
			_ = msg.NakWithDelay(time.Second)
			return
		}
		_ = msg.Ack()
		return
	}
	for j := range m.Index {
		if !st.Done[j] {
			log.Debug("outbox: an earlier callback of the stage is not done; later")
			_ = msg.NakWithDelay(250 * time.Millisecond)
			return
		}
	}
	meta, _ := msg.Metadata()
	attempt := m.Attempts + 1
	if meta != nil {
		attempt = m.Attempts + int(meta.NumDelivered)
	}
	p := s.policyOf(lc.Wire)
	c := st.Callbacks[m.Index]
	ctx = s.traceCtx(ctx, lc)
	err = s.attempt(ctx, m.ID, c.delivery(p), attempt, log)
	if err != nil && !errors.Is(err, errPermanent) {
		if ctx.Err() != nil {
			_ = msg.Nak()
			return
		}
		wait := p.delay(attempt)
		if time.Since(m.Due)+wait < p.Deadline {
			_ = msg.NakWithDelay(wait)
			return
		}
		s.metrics.callbackFails.Inc()
		err = fmt.Errorf("callback to %s: gave up after %d attempts over the delivery deadline (%s): %w", c.URL, attempt, p.Deadline, err)
		log.Error(c.Event+" failed", "error", err)
	}
	next, _, merr := s.markDone(ctx, m.ID, m.Stage, m.Index, c.Event, err, nil)
	if merr != nil {
		log.Warn("shared state: could not mark a callback done; it goes back", "error", merr)
		_ = msg.NakWithDelay(time.Second)
		return
	}
	if !s.send(ctx, nil, m.ID, lc.Created, p, stageFinal, next, false, nil, log) {
		_ = msg.NakWithDelay(time.Second)
		return
	}
	_ = msg.DoubleAck(context.WithoutCancel(ctx))
}

// traceCtx is ctx carrying the trace the rollout was admitted under.
func (s *Service) traceCtx(ctx context.Context, lc *lifecycle) context.Context {
	if s.tracer == nil || len(lc.Trace) == 0 {
		return ctx
	}
	return s.cfg.Propagator.Extract(ctx, propagation.MapCarrier(lc.Trace))
}

// policyOf is the callback policy of a wire.
func (s *Service) policyOf(wire string) callbackPolicy {
	if wire == wireG1 {
		return s.g1Policy
	}
	return s.g2Policy
}

// leases keeps the messages this replica holds from going to another
// replica: each is renewed a few times per ack wait.
type leases struct {
	mu   sync.Mutex
	msgs map[jetstream.Msg]struct{}
}

func (l *leases) hold(m jetstream.Msg) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs[m] = struct{}{}
}

func (l *leases) drop(m jetstream.Msg) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.msgs, m)
}

// renew keeps the held messages held until ctx ends.
func (l *leases) renew(ctx context.Context, every time.Duration, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		l.mu.Lock()
		held := slices.Collect(maps.Keys(l.msgs))
		l.mu.Unlock()
		failed := 0
		for _, m := range held {
			if err := m.InProgress(); err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
				failed++
			}
		}
		if failed > 0 {
			log.Warn("shared state: could not renew the hold on rollouts and callbacks; another replica may take them over", "failed", failed, "held", len(held))
		}
	}
}

// acquire takes a concurrency slot, or fails when ctx ends. release
// gives it back, once however often it is called.
func (s *Service) acquire(ctx context.Context) (release func(), err error) {
	select {
	case s.sem <- struct{}{}:
		return s.releaser(), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// tryAcquire takes a slot if one is free now.
func (s *Service) tryAcquire() (release func(), ok bool) {
	select {
	case s.sem <- struct{}{}:
		return s.releaser(), true
	default:
		return nil, false
	}
}

func (s *Service) releaser() func() {
	return sync.OnceFunc(func() { <-s.sem })
}
