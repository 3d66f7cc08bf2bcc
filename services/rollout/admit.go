package rollout

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// admitTimeout bounds admission's writes to the shared state;
// admissionTimeout a start's whole answer. While the state does not answer,
// a start is refused with Unavailable (which trainers retry) within that
// time, not held for the sum of every step's own bound.
const (
	admitTimeout     = 5 * time.Second
	admissionTimeout = 15 * time.Second
)

// retryAfter is what a trainer is told to wait when the server is full.
const retryAfter = 5 * time.Second

// newRecord is a queued record of id for w; the wire's handler fills in
// the rest.
func (s *Service) newRecord(id, key string, w wire) *record {
	rec := &record{
		id:       id,
		key:      key,
		wire:     w,
		workflow: s.workflow.Name(),
		token:    newToken(),
		state:    rolloutv1.State_STATE_QUEUED,
		created:  time.Now(),
		log:      openEventLog(s.logDir, id),
	}
	rec.initContexts(s.rolloutsCtx)
	return rec
}

// errIDInUse: the rollout id is held under another idempotency key.
var errIDInUse = errors.New("rollout id in use under another key")

// lifecycle is rec's lifecycle as admission writes it, in phase, under the
// trace of the request in ctx.
func (s *Service) lifecycle(ctx context.Context, rec *record, phase string) (*lifecycle, error) {
	req, resp := rec.wire.saved()
	lc := &lifecycle{ID: rec.id, Key: rec.key, Wire: rec.wire.name(), Workflow: rec.workflow, Created: rec.created,
		Phase: phase, State: rolloutv1.State_STATE_QUEUED}
	if phase == phaseRunning {
		// Started here at once (see admit), as begin writes it.
		lc.Owner, lc.State, lc.Started = s.replica, rolloutv1.State_STATE_RUNNING, time.Now()
	} else if s.sh.store.Embedded() {
		// The only replica, which runs the rollout.
		lc.admitted = req
	}
	var err error
	if lc.Request, err = proto.Marshal(req); err != nil {
		return nil, err
	}
	// The request holds the trainer's bearers: sealed in the shared state.
	lc.Request = s.seal.bytes(lc.Request)
	if resp != nil {
		if lc.Response, err = proto.Marshal(resp); err != nil {
			return nil, err
		}
	}
	if s.tracer != nil {
		tagRolloutID(ctx, rec.id)
		lc.Trace = map[string]string{}
		if phase == phaseRunning {
			// The rollout's span, as begin writes it.
			ctx = rec.traced(context.Background())
		}
		s.cfg.Propagator.Inject(ctx, propagation.MapCarrier(lc.Trace))
	}
	return lc, nil
}

// admit writes rec's lifecycle into the shared state in phase, unless its
// id has one already, which is returned. With bounded, a full queue refuses
// rec (ResourceExhausted) unless the state holds its id. A rollout to be
// queued may instead start here at once (startsHere): it is written
// running, rec holds its slot, and enqueue runs it.
func (s *Service) admit(ctx context.Context, rec *record, phase string, bounded bool) (*lifecycle, error) {
	ctx, cancel := context.WithTimeout(ctx, admitTimeout)
	defer cancel()
	if phase == phaseQueued && s.startsHere(rec) {
		phase = phaseRunning
		s.traceRollout(ctx, rec)
	}
	existing, err := s.create(ctx, rec, phase, bounded)
	if rec.placed && (err != nil || existing != nil) {
		s.sh.local.unreserve()
		rec.placed = false
	}
	if rec.slot != nil && (err != nil || existing != nil) {
		// Not started after all; its span, never ended, is not exported.
		s.store.remove(rec)
		rec.slot()
		rec.slot = nil
	}
	if rec.slot == nil {
		// A replica's take rebuilds it from its lifecycle.
		rec.release()
	}
	return existing, err
}

// create writes rec's lifecycle for admit, checking the queue's bound first
// when bounded.
func (s *Service) create(ctx context.Context, rec *record, phase string, bounded bool) (*lifecycle, error) {
	if bounded && phase == phaseQueued {
		if room, n, err := s.sh.admitQueued(ctx, int64(s.cfg.MaxQueued)); err != nil {
			return nil, unavailable(err)
		} else if room {
			rec.placed = s.sh.local != nil
		} else {
			if lc, _, err := s.sh.get(ctx, rec.id); err == nil {
				return lc, nil
			}
			s.metrics.rejected.WithLabelValues(rejectCapacity).Inc()
			st, _ := status.New(codes.ResourceExhausted, fmt.Sprintf("at capacity: %d rollouts queued; retry later", n)).
				WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
			return nil, st.Err()
		}
	}
	lc, err := s.lifecycle(ctx, rec, phase)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encode the rollout: %v", err)
	}
	existing, _, err := s.sh.create(ctx, lc)
	if err != nil {
		return nil, unavailable(err)
	}
	if existing != nil {
		if existing.Key != rec.key {
			return existing, errIDInUse
		}
		if existing.Phase == phaseQueued {
			// Its first start may have failed to queue it: queued again
			// (the stream drops a duplicate, its taker a stale one).
			if err := s.sh.enqueue(ctx, existing, rec.placed); err != nil {
				return nil, unavailable(err)
			}
			rec.placed = false
		}
		return existing, nil
	}
	return nil, nil
}

// startsHere says whether rec, admitted to be queued, starts here at once
// instead, taking a free slot (rec.slot) and its place in the store. Only
// a private state does this, having no other replica to share work with
// (two writes and a trip through the queue saved), and only while nothing
// waits in the queue, so no rollout overtakes one queued before it.
func (s *Service) startsHere(rec *record) bool {
	if s.sh.local == nil || !s.sh.local.empty() {
		return false
	}
	release, ok := s.tryAcquire()
	if !ok {
		return false
	}
	// Not for a duplicate of a rollout under way, which create finds.
	if !s.store.addNew(rec) {
		release()
		return false
	}
	rec.slot = release
	return true
}

// enqueue puts an admitted rollout on the queue, or runs one that starts
// here. One the queue could not take is refused (Unavailable) but its
// lifecycle stays: the publish may have been stored, and the trainer's
// retry queues it again rather than starting a second one.
func (s *Service) enqueue(ctx context.Context, rec *record, event string, fields map[string]any) error {
	release := rec.slot
	rec.slot = nil
	if release == nil {
		lc := &lifecycle{ID: rec.id, Created: rec.created}
		placed := rec.placed
		rec.placed = false
		if err := s.sh.enqueue(ctx, lc, placed); err != nil {
			s.log.ErrorContext(ctx, "shared state: could not queue an accepted rollout; its start is refused until retried", "rollout_id", rec.id, "error", err)
			return unavailable(err)
		}
	}
	rec.log.write(event, fields)
	s.log.InfoContext(ctx, "rollout accepted", "rollout_id", rec.id, "wire", rec.wire.name(), "workflow", rec.workflow, "queued", release == nil)
	s.metrics.started.Inc()
	if release == nil {
		// The record that runs is the one a replica's take rebuilds.
		_ = rec.log.close()
		return nil
	}
	s.wg.Go(func() {
		s.process(rec, release)
	})
	return nil
}

// unavailable is the answer when the shared state cannot be reached (503).
func unavailable(err error) error {
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
		return err
	}
	return status.Errorf(codes.Unavailable, "the rollout state (NATS JetStream) is unreachable: %v", err)
}

// release ends the contexts of a record that will not run here.
func (r *record) release() {
	r.runCancel(nil)
	r.gradeCancel(nil)
}

// newToken is a random bearer for a rollout's clients.
func newToken() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return "osmo-rt-" + hex.EncodeToString(b[:])
}
