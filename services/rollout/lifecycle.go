package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/cenkalti/backoff/v5"
	"github.com/nats-io/nats.go/jetstream"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/retry"
)

// process runs a rollout taken from the queue in the slot it was given,
// then concludes it, the same for every wire, in the rollout's goroutine.
func (s *Service) process(rec *record, release func()) {
	log := s.log.With("rollout_id", rec.id, "wire", rec.wire.name())
	s.run(rec, log, release, func(run outcome.Outcome) { s.conclude(rec, run, nil, log) })
}

// conclude is the rest of a rollout's life once its run ended (run says
// how): owe and send the callbacks due once it ran, grade meanwhile, owe
// and send those due once the outcome is final, and finish. A stage is owed
// in the lifecycle before its first callback is posted.
//
// It also concludes a rollout whose replica was lost (resumed is its
// lifecycle as left): each stage reached is taken as it is, its callbacks
// sent again where not done, and the first stage not reached reports the
// interruption.
func (s *Service) conclude(rec *record, run outcome.Outcome, resumed *lifecycle, log *slog.Logger) {
	defer func() {
		if err := rec.log.close(); err != nil {
			log.Warn("event log", "error", err)
		}
	}()
	// Owed even when cancelled or shutting down.
	ctx := rec.traced(s.deliverCtx)
	final := run
	grading := resumed == nil && run.OK() && s.cfg.Grader != nil && rec.gradable
	if grading {
		rec.setState(rolloutv1.State_STATE_GRADING)
	} else {
		if resumed == nil && run.OK() {
			rec.log.write("grading_skipped", map[string]any{
				"has_grader": s.cfg.Grader != nil, "has_label": rec.label != nil, "has_metadata": rec.metadata != nil,
			})
		}
		if resumed != nil && resumed.Ran != nil && run.OK() && resumed.Final == nil && s.cfg.Grader != nil && rec.gradable {
			// Its samples went with the replica that graded them.
			final = outcome.Failed(outcome.Agent, "%s", s.lostMessage(resumed, "while the rollout was being graded"))
		}
		rec.settle(final)
	}

	// A stage owed before the rollout was resumed may be in the outbox
	// already: it is handed over again (the outbox drops duplicates).
	direct := true
	var ran *owedStage
	if resumed != nil && resumed.Ran != nil {
		ran, direct = resumed.Ran, false
	} else {
		var err error
		if ran, _, err = s.oweStage(ctx, rec.id, stageRan, s.newStage(rec, run, rec.wire.ran(rec, run), log)); err != nil {
			s.abandon(rec, err, log)
			return
		}
	}
	// Grading goes on while the first callbacks are sent.
	sent := make(chan bool, 1)
	ranTried := make(chan struct{})
	pending := &pendingFinal{}
	go func() {
		ok := s.send(ctx, rec, rec.id, rec.created, s.policyOf(rec.wire.name()), stageRan, ran, direct, pending, log)
		close(ranTried)
		sent <- ok
	}()
	if grading {
		final = s.grade(rec, log)
		rec.settle(final)
	}
	var fin *owedStage
	finDirect := true
	if resumed != nil && resumed.Final != nil {
		fin, final, finDirect = resumed.Final, resumed.Final.Outcome.outcome(), false
		rec.settleFrom(resumed)
	} else {
		// The final stage (its bodies carry every sample) is owed with the
		// first stage's mark when that comes soon (see pendingFinal); a
		// trainer slow to answer holds it up for at most Config.FinalWait.
		ds := rec.wire.finished(rec, run, final)
		pending.set(func() *stageToOwe { return s.newStage(rec, final, ds, log) })
		select {
		case <-ranTried:
		case <-time.After(s.cfg.FinalWait):
		}
		if !pending.stop() {
			var (
				err       error
				viaOutbox bool
			)
			if fin, viaOutbox, err = s.oweStage(ctx, rec.id, stageFinal, s.newStage(rec, final, ds, log)); err != nil {
				<-sent
				s.abandon(rec, err, log)
				return
			}
			finDirect = !viaOutbox
		}
	}
	ok := s.send(ctx, rec, rec.id, rec.created, s.policyOf(rec.wire.name()), stageFinal, fin, finDirect, nil, log)
	ok = <-sent && ok
	if ok {
		s.awaitDelivered(rec)
	}
	s.finish(rec, final, ok, log)
}

// lostMessage says a rollout was interrupted by the loss of its replica.
func (s *Service) lostMessage(lc *lifecycle, when string) string {
	if s.sh.store.Embedded() {
		return "interrupted by a restart of the rollout service " + when
	}
	return fmt.Sprintf("interrupted: replica %s lost %s", lc.Owner, when)
}

// newStage is a stage to owe, its bodies encoded.
func (s *Service) newStage(rec *record, o outcome.Outcome, ds []delivery, log *slog.Logger) *stageToOwe {
	st := &owedStage{Outcome: saveOutcome(o), Callbacks: make([]savedCallback, len(ds)), Done: make([]bool, len(ds))}
	for i, d := range ds {
		payload, err := json.Marshal(d.body)
		if err != nil {
			log.Error("encode callback", "event", d.event, "error", err)
			payload = []byte(`{}`)
		}
		st.Callbacks[i] = savedCallback{Event: d.event, Route: d.route, URL: d.url, Bearer: s.seal.text(d.bearer), Status: d.status, Payload: payload}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return &stageToOwe{st: st, state: rec.state, reward: rec.reward}
}

// stageToOwe is a stage, and the rollout's state and reward when owed.
type stageToOwe struct {
	st     *owedStage
	state  rolloutv1.State
	reward *float64
}

// oweStage writes a stage built by newStage into the rollout's lifecycle
// before any of its callbacks is posted, and returns the stage as stored:
// its Sending says whether this replica is to send it now (always the
// first stage; the final one once the first is done). A stage that owes
// nothing is done at once. viaOutbox says the stage is to be handed to
// the outbox rather than posted (see below).
func (s *Service) oweStage(ctx context.Context, id, stage string, t *stageToOwe) (_ *owedStage, viaOutbox bool, _ error) {
	var written *owedStage // the stage, when an earlier try wrote it
	lc, err := s.persist(ctx, id, func(lc *lifecycle) error {
		written, viaOutbox = nil, false
		if lc.Owner != s.replica {
			return errNotOwner
		}
		// A try whose answer was lost may have written the stage already.
		// The first stage is this replica's to send either way; a final
		// one already Sending may be being posted, so it goes through the
		// outbox, which keeps one hand-over.
		if prev := lc.stage(stage); prev != nil {
			cp := *prev
			cp.Sending = stage == stageRan || prev.Sending
			written, viaOutbox = &cp, stage == stageFinal && prev.Sending
			return errUnchanged
		}
		t.applyTo(lc, stage)
		return nil
	})
	if errors.Is(err, errUnchanged) && written != nil {
		return written, viaOutbox, nil
	}
	if err != nil {
		return nil, false, err
	}
	if stage == stageRan {
		return lc.Ran, false, nil
	}
	return lc.Final, false, nil
}

// applyTo owes t as stage in lc, which owes no such stage yet.
func (t *stageToOwe) applyTo(lc *lifecycle, stage string) {
	cp := *t.st
	cp.Done = append([]bool(nil), t.st.Done...)
	lc.State = t.state
	switch stage {
	case stageRan:
		cp.Sending = true
		lc.Ran, lc.Phase = &cp, phaseRan
		if t.state != rolloutv1.State_STATE_GRADING {
			lc.Outcome, lc.Reward = &cp.Outcome, t.reward
		}
	case stageFinal:
		cp.Sending = lc.Ran.done()
		lc.Final, lc.Phase = &cp, phaseFinal
		lc.Outcome, lc.Reward = &cp.Outcome, t.reward
		lc.Request, lc.admitted = nil, nil
	}
	settleFinished(lc)
}

// persist is update, retried while the shared state does not answer, for
// up to twice LostAfter. errNotOwner, errGone and errUnchanged are answers,
// returned at once, as is the error of an update made when ctx ended.
func (s *Service) persist(ctx context.Context, id string, change func(lc *lifecycle) error) (*lifecycle, error) {
	var last error
	lc, err := backoff.Retry(ctx, func() (*lifecycle, error) {
		lc, err := s.sh.update(ctx, id, change)
		last = err
		if err != nil && (errors.Is(err, errNotOwner) || errors.Is(err, errGone) || errors.Is(err, errUnchanged) || ctx.Err() != nil) {
			return lc, backoff.Permanent(err)
		}
		return lc, err
	},
		backoff.WithBackOff(retry.SharedState()),
		backoff.WithMaxElapsedTime(2*s.cfg.LostAfter),
		backoff.WithNotify(func(err error, _ time.Duration) {
			s.log.Warn("shared state: a write failed; retrying", "rollout_id", id, "error", err)
		}))
	if err != nil && ctx.Err() != nil && last != nil {
		err = last // ended while waiting: the write's own failure says more
	}
	return lc, err
}

// errNotOwner: another replica concluded the rollout (it took this one
// for lost); this one's result is dropped.
var errNotOwner = errors.New("the rollout was concluded by another replica, which took this one for lost")

// abandon drops a rollout whose lifecycle this replica could not write;
// unless another replica concluded it, its work stays unacknowledged for a
// replica to conclude once the state is back.
func (s *Service) abandon(rec *record, err error, log *slog.Logger) {
	if errors.Is(err, errNotOwner) {
		log.Error("rollout concluded elsewhere; dropping this replica's result", "error", err)
		s.releaseWork(rec, true)
	} else {
		log.Error("shared state: could not record the rollout's stage; another replica concludes it", "error", err)
		s.releaseWork(rec, false)
	}
	s.store.remove(rec)
	endRolloutSpan(rec, "abandoned", outcome.Failed(outcome.Agent, "%v", err))
}

// settleFinished marks lc finished when both stages are owed and done.
func settleFinished(lc *lifecycle) {
	if lc.Ran.done() && lc.Final.done() && lc.Phase != phaseFinished {
		lc.Phase, lc.Finished, lc.Request, lc.admitted = phaseFinished, time.Now(), nil, nil
		lc.Ran.Callbacks, lc.Final.Callbacks = nil, nil
	}
}

// record stores the finished rollout's rendering for GetRollout and
// watchers; until it is stored, this replica's live record answers.
func (s *Service) record(rec *record, log *slog.Logger) {
	rec.mu.Lock()
	rec.finished = time.Now()
	rec.mu.Unlock()
	b, err := json.Marshal(rec.render())
	if err == nil {
		// Created once: a rollout concluded again (its first replica gone
		// before every callback was out) keeps the record first stored, so
		// that a watcher or a rows stream resuming after it never gets the
		// rollout twice.
		var rev uint64
		rev, err = s.sh.records.Create(s.deliverCtx, natsstore.Key(rec.id), b)
		s.sh.wrote(len(b))
		if errors.Is(err, jetstream.ErrKeyExists) {
			if e, gerr := s.sh.records.Get(s.deliverCtx, natsstore.Key(rec.id)); gerr == nil {
				rec.setSeq(int64(e.Revision()))
			}
			return
		}
		if err == nil {
			rec.setSeq(int64(rev))
			return
		}
	}
	// GetRollout then answers from the lifecycle.
	log.Warn("shared state: the finished record was not stored", "bytes", len(b), "error", err)
}

// finish counts a concluded rollout and lets go of its record and its
// work: acknowledged when sent says every callback was delivered or is in
// the outbox, else left for a replica to conclude again.
func (s *Service) finish(rec *record, o outcome.Outcome, sent bool, log *slog.Logger) {
	rec.mu.Lock()
	reward := rec.reward
	rec.mu.Unlock()
	word := rec.wire.statusWord(o)
	s.completed.Add(1)
	s.metrics.finished.WithLabelValues(word, string(o.Category)).Inc()
	s.metrics.duration.WithLabelValues(word).Observe(time.Since(rec.created).Seconds())
	if reward != nil {
		s.metrics.rewards.Observe(*reward)
	}
	log.Info("rollout finished", "status", word, "category", o.Category, "reward", reward)
	s.countRows(rec)
	endRolloutSpan(rec, word, o)
	s.record(rec, log)
	s.releaseWork(rec, sent)
	s.store.remove(rec)
	rec.freeze()
}

// releaseWork lets go of the rollout's work message, acknowledged when done.
func (s *Service) releaseWork(rec *record, done bool) {
	msg := s.detachWork(rec)
	if msg == nil {
		return
	}
	if done {
		if err := msg.Ack(); err != nil {
			s.log.Warn("shared state: could not acknowledge a rollout's work; it will be concluded again from its lifecycle (its callbacks are done, so nothing is sent twice)",
				"rollout_id", rec.id, "error", err)
		}
	}
}

// detachWork takes the rollout's work message (nil if none) out of its
// record and the leases.
func (s *Service) detachWork(rec *record) jetstream.Msg {
	rec.mu.Lock()
	msg := rec.work
	rec.work = nil
	rec.mu.Unlock()
	if msg != nil {
		s.leases.drop(msg)
	}
	return msg
}

// settleFrom sets a resumed rollout's final outcome and reward from its
// lifecycle.
func (r *record) settleFrom(lc *lifecycle) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if lc.Outcome != nil {
		r.out, r.final, r.state = lc.Outcome.outcome(), true, lc.Outcome.State
	}
	r.reward = lc.Reward
}

// renderLifecycle is GetRollout's answer for a rollout known only by its
// lifecycle.
func renderLifecycle(lc *lifecycle) *rolloutv1.Rollout {
	out := &rolloutv1.Rollout{
		RolloutId:     lc.ID,
		State:         lc.State,
		Workflow:      lc.Workflow,
		Reward:        lc.Reward,
		CallbackError: lc.CallbackError,
		Wire:          lc.Wire,
		Metrics:       &rolloutv1.RolloutMetrics{},
	}
	out.CreatedAt = timestamp(lc.Created)
	out.StartedAt = timestamp(lc.Started)
	out.FinishedAt = timestamp(lc.Finished)
	if lc.Outcome != nil {
		out.ErrorMessage, out.ErrorCategory = lc.Outcome.Message, string(lc.Outcome.Category)
	}
	return out
}

// encode is lc as stored. Not inline, the request and the callbacks'
// payloads are left out (a private state's are kept in process:
// localBodies).
func (lc *lifecycle) encode(inline bool) ([]byte, error) {
	if !inline {
		cp := *lc
		cp.Request = nil
		cp.Ran, cp.Final = lc.Ran.withoutPayloads(), lc.Final.withoutPayloads()
		lc = &cp
	}
	return json.Marshal(lc)
}

// withoutPayloads is a copy of st whose callbacks carry no payload.
func (st *owedStage) withoutPayloads() *owedStage {
	if st == nil {
		return nil
	}
	cp := *st
	cp.Callbacks = slices.Clone(st.Callbacks)
	for i := range cp.Callbacks {
		cp.Callbacks[i].Payload = nil
	}
	return &cp
}

// timestamp is t as a proto timestamp, nil when zero.
func timestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}
