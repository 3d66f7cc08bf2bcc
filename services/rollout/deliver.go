package rollout

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/netguard"
	"github.com/osmo-rl/osmo/internal/retry"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// delivery is one callback a wire owes the trainer.
type delivery struct {
	// event names it in the event log and its span ("deliver_"+event);
	// route names its HTTP attempts' spans: the URL's fixed part.
	event  string
	route  string
	url    string
	bearer string
	// body is encoded to payload when the delivery is owed.
	body    any
	payload []byte
	// status is the status word the body carries.
	status string
	policy callbackPolicy
}

// send delivers a stage's callbacks not yet done, in order, when this
// replica is to (st.Sending): each is tried once here when direct, and one
// that fails transiently goes to the outbox with the ones after it. A
// callback done with is marked in the lifecycle; the mark that completes
// the first stage starts the final one. It reports false when a callback
// could be neither delivered nor handed over: the rollout's work then stays
// held, for a replica to conclude it again.
//
// rec is the rollout's record when this replica holds it (nil in the
// outbox); final is the final stage waiting for the first stage's marks
// (see pendingFinal), or nil.
func (s *Service) send(ctx context.Context, rec *record, id string, created time.Time, p callbackPolicy, stage string, st *owedStage, direct bool, final *pendingFinal, log *slog.Logger) bool {
	if st == nil || !st.Sending {
		return true
	}
	ok := true
	for i, c := range st.Callbacks {
		if i < len(st.Done) && st.Done[i] {
			continue
		}
		attempts := 0
		if direct && ctx.Err() == nil {
			attempts = 1
			err := s.attempt(ctx, id, c.delivery(p), 1, log)
			if rec != nil {
				fields := map[string]any{"status": c.Status, "attempts": 1}
				if err != nil {
					fields["error"] = err.Error()
				}
				rec.log.write(c.Event, fields)
			}
			if err == nil || errors.Is(err, errPermanent) {
				if err != nil && rec != nil {
					rec.addCallbackError(c.Event, err)
				}
				next, viaOutbox, merr := s.markDone(ctx, id, stage, i, c.Event, err, final)
				if merr != nil {
					log.Error("shared state: could not mark a callback done; it may be sent again", "event", c.Event, "error", merr)
					ok = false
				}
				// The owner (rec) posts the final stage itself; from the
				// outbox it is handed over, and the outbox keeps one.
				ok = s.send(ctx, rec, id, created, p, stageFinal, next, rec != nil && !viaOutbox, nil, log) && ok
				continue
			}
			// Later callbacks of the stage wait for this one in the outbox.
			direct = false
		}
		err := s.sh.handOver(context.WithoutCancel(ctx), created, outboxMsg{ID: id, Stage: stage, Index: i, Attempts: attempts, Due: time.Now()})
		if err != nil {
			log.Error("shared state: could not hand a callback to the outbox; the rollout is left for a replica to conclude again", "event", c.Event, "error", err)
			ok = false
		} else if rec != nil {
			rec.handed.Store(true)
		}
	}
	return ok
}

// markDone marks a stage's callback done with (cbErr says how it failed,
// nil when delivered) and returns the final stage when this mark lets it be
// sent. The mark is retried while the shared state does not answer: a mark
// given up on sends the callback again, and returns no final stage.
//
// A retry may find the mark written by its own earlier try, whose answer
// was lost and which may have let the final stage go: that stage is
// returned with viaOutbox set, to be handed to the outbox (which keeps one
// hand-over) rather than posted. A mark of the first stage owes the final
// stage waiting for it, if any, in the same write (see pendingFinal).
func (s *Service) markDone(ctx context.Context, id, stage string, i int, event string, cbErr error, final *pendingFinal) (next *owedStage, viaOutbox bool, err error) {
	var fin *stageToOwe
	if stage == stageRan {
		if build := final.take(); build != nil {
			fin = build()
		}
	}
	tries := 0
	lc, err := s.persist(context.WithoutCancel(ctx), id, func(lc *lifecycle) error {
		tries++
		next, viaOutbox = nil, false
		st := lc.stage(stage)
		if st == nil || i >= len(st.Done) {
			return errUnchanged
		}
		if st.Done[i] {
			if tries > 1 && stage == stageRan && lc.Final != nil && lc.Final.Sending && !lc.Final.done() {
				next, viaOutbox = lc.Final, true
			}
			return errUnchanged
		}
		if fin != nil && lc.Final == nil && lc.Owner == s.replica {
			fin.applyTo(lc, stageFinal)
		}
		st.Done[i] = true
		// Never posted again: its body and bearer leave the state.
		st.Callbacks[i].Payload, st.Callbacks[i].Bearer = nil, ""
		if cbErr != nil {
			if lc.CallbackError != "" {
				lc.CallbackError += "; "
			}
			lc.CallbackError += event + ": " + cbErr.Error()
		}
		if stage == stageRan && lc.Final != nil && !lc.Final.Sending && lc.Ran.done() {
			lc.Final.Sending = true
			next = lc.Final
		}
		settleFinished(lc)
		return nil
	})
	if fin != nil {
		// Owed if the lifecycle last written or read has a final stage while
		// this replica still owns it.
		final.written((err == nil || errors.Is(err, errUnchanged)) && lc != nil && lc.Final != nil && lc.Owner == s.replica)
	}
	switch {
	case errors.Is(err, errUnchanged):
		return next, viaOutbox, nil
	case errors.Is(err, errGone):
		return nil, false, nil
	case err != nil:
		// The last try's change may have started the final stage, but in
		// a write not made (or not answered): posted from here, it would
		// be a delivery the lifecycle does not record, and the replica
		// that concludes the rollout again (its work stays held) would
		// post it once more. That replica sends it after the mark.
		return nil, false, err
	}
	if lc.Phase == phaseFinished {
		s.waiters.notify(id)
	}
	return next, false, nil
}

// pendingFinal is a rollout's final stage, once graded, waiting for the
// mark of its first stage's callback, which mostly comes after grading:
// one write then marks it and owes the final stage, instead of a write for
// each. The conclusion sets the stage and, once the first stage was tried
// or Config.FinalWait passed, stops waiting; it owes the stage itself unless a
// mark took it. What is set builds the stage, so the bodies (the grader
// callback carries every sample) are not held encoded while it waits.
type pendingFinal struct {
	mu    sync.Mutex
	stage func() *stageToOwe
	// closed: taken by a mark, or stopped.
	closed bool
	// taken is closed once the mark that took the stage was written,
	// owed saying whether that write owed the stage.
	taken chan struct{}
	owed  bool
}

// set makes the stage t builds the one a mark takes, unless stopped.
func (f *pendingFinal) set(t func() *stageToOwe) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.closed {
		f.stage = t
	}
}

// take gives a mark about to be written what builds the stage, or nil when
// none is set (f nil included). A mark that took it reports its write
// (written).
func (f *pendingFinal) take() func() *stageToOwe {
	if f == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed || f.stage == nil {
		return nil
	}
	t := f.stage
	f.stage, f.closed, f.taken = nil, true, make(chan struct{})
	return t
}

// written says whether the write of the mark that took the stage owed it.
func (f *pendingFinal) written(owed bool) {
	f.owed = owed
	close(f.taken)
}

// stop ends the wait for a mark and reports whether a mark owed the stage,
// waiting for the write of a mark that took it.
func (f *pendingFinal) stop() bool {
	f.mu.Lock()
	f.closed, f.stage = true, nil
	taken := f.taken
	f.mu.Unlock()
	if taken == nil {
		return false
	}
	<-taken
	return f.owed
}

// awaitDelivered waits, when some of a rollout's callbacks went to the
// outbox, until the outbox is done with them (or shutdown), so that the
// finished record says how they went, as when none failed. It hears of a
// delivery made here at once, of one made elsewhere within a second.
func (s *Service) awaitDelivered(rec *record) {
	if !rec.handed.Load() {
		return
	}
	ch := s.waiters.add(rec.id)
	defer s.waiters.remove(rec.id)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	log := s.log.With("rollout_id", rec.id)
	rehand := time.Now().Add(repairEvery)
	for {
		lc, _, err := s.sh.get(s.deliverCtx, rec.id)
		if errors.Is(err, errGone) {
			// Expired or removed: nothing is left to deliver.
			return
		}
		if err == nil && lc.Ran.done() && lc.Final.done() {
			rec.mu.Lock()
			rec.callbackErr = lc.CallbackError
			rec.mu.Unlock()
			return
		}
		if err == nil && time.Now().After(rehand) {
			rehand = time.Now().Add(repairEvery)
			s.repair(lc, log)
		}
		select {
		case <-ch:
		case <-t.C:
		case <-s.deliverCtx.Done():
			return
		}
	}
}

// repairEvery is how often a rollout awaiting its callbacks checks that the
// outbox still holds them.
const repairEvery = 5 * time.Second

// repair hands over again each callback being sent that the outbox does
// not hold: a hand-over whose message was lost (a process killed before its
// embedded server wrote it, a NATS node that died before replicating it).
func (s *Service) repair(lc *lifecycle, log *slog.Logger) {
	for _, name := range stageNames {
		st := lc.stage(name)
		if st == nil || !st.Sending {
			continue
		}
		for i, done := range st.Done {
			if done {
				continue
			}
			held, err := s.sh.inOutbox(s.deliverCtx, lc.ID, name, i)
			if err != nil {
				log.Warn("shared state: could not look for a callback in the outbox", "stage", name, "index", i, "error", err)
				break
			}
			if held {
				log.Debug("outbox: holds the callback", "stage", name, "index", i)
				break
			}
			log.Warn("shared state: a callback owed is not in the outbox; handing it over again", "stage", name, "index", i)
			m := outboxMsg{ID: lc.ID, Stage: name, Index: i, Due: time.Now(), again: true}
			if err := s.sh.handOver(s.deliverCtx, lc.Created, m); err != nil {
				log.Error("shared state: could not hand a callback over again", "error", err)
			}
			break // the stage's later callbacks wait for this one
		}
	}
}

// waiters wake the rollouts awaiting their callbacks' delivery.
type waiters struct {
	mu sync.Mutex
	m  map[string]chan struct{}
}

func (w *waiters) add(id string) chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m == nil {
		w.m = map[string]chan struct{}{}
	}
	ch := make(chan struct{}, 1)
	w.m[id] = ch
	return ch
}

func (w *waiters) remove(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.m, id)
}

func (w *waiters) notify(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	select {
	case w.m[id] <- struct{}{}:
	default:
	}
}

// attempt posts one callback once, in a span of its own under ctx, and
// counts it. A failure that retrying can fix is returned as it is; one
// that it cannot wraps errPermanent.
func (s *Service) attempt(ctx context.Context, id string, d delivery, n int, log *slog.Logger) error {
	ctx, span := s.startSpan(ctx, "deliver_"+d.event, trace.SpanKindInternal,
		semconv.URLFull(d.url), osmoattr.RolloutStatus.String(d.status), osmoattr.Attempt.Int(n))
	defer span.End()
	// A bearer read back from the shared state is sealed (see seal).
	bearer, err := s.seal.openText(d.bearer)
	if err != nil {
		err = fmt.Errorf("%w: the bearer: %w", errPermanent, err)
	} else {
		err = s.postOnce(context.WithValue(ctx, attemptRouteKey{}, d.route), d, bearer)
	}
	switch {
	case err == nil:
		s.metrics.callbacks.WithLabelValues("ok").Inc()
		log.DebugContext(ctx, "callback delivered", "rollout_id", id, "event", d.event, "attempt", n)
		return nil
	case errors.Is(err, errPermanent):
		s.metrics.callbacks.WithLabelValues("failed").Inc()
		s.metrics.callbackFails.Inc()
		err = fmt.Errorf("callback to %s: %w", d.url, err)
		log.ErrorContext(ctx, d.event+" refused", "rollout_id", id, "error", err, "attempt", n)
	default:
		s.metrics.callbacks.WithLabelValues("retry").Inc()
		log.WarnContext(ctx, "callback attempt failed", "rollout_id", id, "event", d.event, "url", d.url, "attempt", n, "error", err)
	}
	fail(span, "callback_failed", err.Error())
	return err
}

// postRetried delivers a refused start's callback under its policy,
// retrying in place until the delivery deadline: a refused start has no
// lifecycle to keep its callbacks in the outbox.
func (s *Service) postRetried(ctx context.Context, id string, d delivery) {
	p := d.policy
	first := time.Now()
	for attempt := 1; ; attempt++ {
		err := s.attempt(ctx, id, d, attempt, s.log)
		if err == nil || errors.Is(err, errPermanent) || ctx.Err() != nil {
			return
		}
		wait := p.delay(attempt)
		if time.Since(first)+wait >= p.Deadline {
			s.metrics.callbackFails.Inc()
			s.log.Error(d.event+" failed", "rollout_id", id,
				"error", fmt.Errorf("callback to %s: gave up after %d attempts over the delivery deadline (%s): %w", d.url, attempt, p.Deadline, err))
			return
		}
		sleepCtx(ctx, wait)
	}
}

// attemptRouteKey carries a delivery's route to the span of each attempt.
type attemptRouteKey struct{}

// attemptSpanName names a callback attempt's client span after its route.
func attemptSpanName(r *http.Request) string {
	if route, ok := r.Context().Value(attemptRouteKey{}).(string); ok {
		return "POST " + route
	}
	return "POST callback"
}

// callbackPolicy is a wire's retry rule for its callbacks: Delivered says
// which answers count, Retryable which are worth another attempt (the rest
// fail at once); a transport error is always retried. Each attempt is
// bounded by Timeout; attempts go on, BaseDelay doubling up to MaxDelay
// apart, until Deadline after the first.
type callbackPolicy struct {
	BaseDelay time.Duration
	MaxDelay  time.Duration
	Timeout   time.Duration
	Deadline  time.Duration
	Delivered func(code int) bool
	Retryable func(code int) bool
}

// g1Delivered and g1Retryable are the G1 completion rule: only a 200
// counts, a 5xx is retried.
func g1Delivered(code int) bool { return code == http.StatusOK }
func g1Retryable(code int) bool { return code >= 500 }

// g2Delivered and g2Retryable are the G2 and v0.3 callback rule: any 2xx
// delivers; 429, 500, 502, 503 and 504 are retried.
func g2Delivered(code int) bool { return code >= 200 && code <= 299 }
func g2Retryable(code int) bool {
	switch code {
	case http.StatusTooManyRequests, http.StatusInternalServerError, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// backOff is the policy's schedule of waits, without jitter, as the wire
// documents it: deliveries that fail together are spread anyway by
// Callbacks.MaxInFlight.
func (p callbackPolicy) backOff() *backoff.ExponentialBackOff {
	return retry.Doubling(p.BaseDelay, p.MaxDelay, 0)
}

// delay is the wait before retry attempt (from 1).
func (p callbackPolicy) delay(attempt int) time.Duration {
	return retry.Nth(p.backOff(), attempt)
}

// errPermanent marks a callback failure that retrying cannot fix.
var errPermanent = errors.New("not retried")

// drainLimit is how much of a trainer's answer to a delivered callback is
// read so that its connection can be used again; a longer one closes it.
const drainLimit = 64 << 10

// postOnce posts d once, in a callback slot, its timeout running from when
// it is sent.
func (s *Service) postOnce(ctx context.Context, d delivery, bearer string) error {
	select {
	case s.callbackSlots <- struct{}{}:
		defer func() { <-s.callbackSlots }()
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	p := d.policy
	ctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.url, bytes.NewReader(d.payload))
	if err != nil {
		return fmt.Errorf("%w: build request: %v", errPermanent, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := s.callbackClient.Do(req)
	if netguard.Refused(err) {
		// The outbound policy refuses this address (or the endpoint
		// redirects elsewhere): it will again, however long we retry.
		return fmt.Errorf("%w: %w", errPermanent, err)
	}
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if p.Delivered(resp.StatusCode) {
		// Drained, so the connection is used again.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		return nil
	}
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	switch {
	case p.Retryable(resp.StatusCode):
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(snippet))
	default:
		return fmt.Errorf("%w: HTTP %d: %s", errPermanent, resp.StatusCode, bytes.TrimSpace(snippet))
	}
}
