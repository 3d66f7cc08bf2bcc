package rollout

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// retryAfter is what a trainer is told to wait when the server is full.
const retryAfter = 5 * time.Second

// newRecord is a queued record of id for w, with its contexts; the wire's
// handler fills in the rest before admitting it.
func (s *Service) newRecord(id, key string, w wire) *record {
	rec := &record{
		id:       id,
		key:      key,
		wire:     w,
		workflow: s.workflow.Name(),
		token:    newToken(),
		state:    rolloutv1.State_STATE_QUEUED,
		created:  time.Now(),
		log:      s.logs.open(id),
	}
	rec.initContexts(s.rolloutsCtx)
	return rec
}

// errIDInUse: the rollout id is held under another idempotency key.
var errIDInUse = errors.New("rollout id in use under another key")

// admit enters rec into the store, unless a record holds its key already:
// then it returns that one (dup) and rec is released. With bounded, a
// server whose queue is full refuses rec (ResourceExhausted, with the
// delay to retry after) unless its id is one the server holds, whose
// duplicate start costs nothing.
func (s *Service) admit(rec *record, bounded bool) (existing *record, dup bool, err error) {
	s.admitMu.Lock()
	defer s.admitMu.Unlock()
	if bounded && s.queued.Load() >= int64(s.cfg.MaxQueued) && s.store.get(rec.id) == nil {
		rec.release()
		s.metrics.rejected.WithLabelValues(rejectCapacity).Inc()
		st, _ := status.New(codes.ResourceExhausted, fmt.Sprintf("at capacity: %d rollouts running and %d queued; retry later", s.running.Load(), s.queued.Load())).
			WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
		return nil, false, st.Err()
	}
	existing, dup, ok := s.store.admit(rec)
	switch {
	case !ok:
		rec.release()
		return existing, false, errIDInUse
	case dup:
		rec.release()
		return existing, true, nil
	}
	s.queued.Add(1)
	return rec, false, nil
}

// forget takes back the admission of a record that will not run (a G1 init
// whose tools failed), so a retry starts afresh.
func (s *Service) forget(rec *record) {
	s.store.forget(rec)
	s.queued.Add(-1)
	rec.release()
}

// release ends the contexts of a record that will not run.
func (r *record) release() {
	r.runCancel(nil)
	r.gradeCancel(nil)
}

// start hands an admitted rollout to its lifecycle: it records the
// acceptance in the state log (on disk before the trainer hears of it), opens
// the rollout's span under the request's in ctx, writes the wire's
// admission event and starts the rollout's goroutine. A rollout the state
// log could not take is forgotten and refused (Unavailable): accepting it
// would promise a callback a crash could lose.
func (s *Service) start(ctx context.Context, rec *record, event string, fields map[string]any) error {
	if err := s.state.accepted(rec); err != nil {
		s.forget(rec)
		s.log.ErrorContext(ctx, "state log: could not record an accepted rollout; refused it", "rollout_id", rec.id, "error", err)
		return status.Errorf(codes.Unavailable, "the server could not record the rollout durably: %v", err)
	}
	s.traceRollout(ctx, rec)
	rec.log.write(event, fields)
	s.log.InfoContext(ctx, "rollout accepted", "rollout_id", rec.id, "wire", rec.wire.name(), "workflow", rec.workflow)
	s.metrics.started.Inc()
	s.metrics.queued.Inc()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.process(rec)
	}()
	return nil
}

// newToken is a random bearer for a rollout's clients.
func newToken() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return "osmo-rt-" + hex.EncodeToString(b[:])
}
