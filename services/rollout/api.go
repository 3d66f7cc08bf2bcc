package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// GetRollout returns a rollout's record: this replica's live one, the
// stored finished one, the live one of the replica running it, or else
// what its lifecycle says.
func (s *Service) GetRollout(ctx context.Context, req *rolloutv1.GetRolloutRequest) (*rolloutv1.Rollout, error) {
	id := req.GetRolloutId()
	if id == "" {
		return nil, fielderr.New("rollout_id", "required")
	}
	if rec := s.store.get(id); rec != nil {
		out, err := rec.proto()
		if err != nil {
			return nil, status.Errorf(codes.Internal, "render rollout %q: %v", id, err)
		}
		return out, nil
	}
	lc, _, err := s.sh.get(ctx, id)
	switch {
	case errors.Is(err, errGone):
		return nil, status.Errorf(codes.NotFound, "rollout %q not found", id)
	case err != nil:
		return nil, unavailable(err)
	}
	if lc.Outcome != nil && lc.State != rolloutv1.State_STATE_GRADING {
		if out, err := s.finishedRecord(ctx, lc); err == nil {
			return out, nil
		}
	}
	// The owner answers while the rollout runs, and just after it
	// finished, before it stored the record.
	if lc.Owner != "" && lc.Owner != s.replica && (lc.Phase != phaseFinished || time.Since(lc.Finished) < recordSettle) {
		out, err := s.askOwner(ctx, lc.Owner, id)
		if err == nil {
			return out, nil
		}
		if errors.Is(err, errGone) && lc.Outcome != nil {
			if out, err := s.finishedRecord(ctx, lc); err == nil {
				return out, nil
			}
		}
	}
	return renderLifecycle(lc), nil
}

// recordSettle is how long after a rollout finished its owner may still be
// storing its record.
const recordSettle = 10 * time.Second

// finishedRecord reads a finished rollout's stored record, with the
// callback errors of its lifecycle (the outbox may have given up on some
// after the record was stored).
func (s *Service) finishedRecord(ctx context.Context, lc *lifecycle) (*rolloutv1.Rollout, error) {
	e, err := s.sh.records.Get(ctx, natsstore.Key(lc.ID))
	if err != nil {
		return nil, err
	}
	out, err := rolloutProto(e.Value())
	if err != nil {
		return nil, err
	}
	out.Sequence = int64(e.Revision())
	out.CallbackError = lc.CallbackError
	return out, nil
}

// askOwner asks the replica holding a rollout for its live record.
func (s *Service) askOwner(ctx context.Context, owner, id string) (*rolloutv1.Rollout, error) {
	b, err := s.askOwnerJSON(ctx, owner, id)
	if err != nil {
		return nil, err
	}
	return rolloutProto(b)
}

// answerGets serves askOwner for the rollouts this replica holds.
func (s *Service) answerGets(msg *nats.Msg) {
	var b []byte
	if rec := s.store.get(string(msg.Data)); rec != nil {
		b, _ = json.Marshal(rec.render())
	}
	_ = msg.Respond(b)
}

// WatchRollouts streams finished rollouts, from every replica, in the
// order their records were stored; after_sequence replays those stored
// after it that are still kept.
func (s *Service) WatchRollouts(req *rolloutv1.WatchRolloutsRequest, stream grpc.ServerStreamingServer[rolloutv1.Rollout]) error {
	if req.GetAfterSequence() < -1 {
		return fielderr.New("after_sequence", "must be -1 or more, got %d", req.GetAfterSequence())
	}
	ctx := stream.Context()
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{"$KV." + bucketRecords + ".>"}, DeliverPolicy: jetstream.DeliverNewPolicy}
	if after := req.GetAfterSequence(); after >= 0 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, uint64(after)+1
	}
	cons, err := s.sh.js.OrderedConsumer(ctx, "KV_"+bucketRecords, cfg)
	if err != nil {
		return unavailable(err)
	}
	it, err := cons.Messages()
	if err != nil {
		return unavailable(err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		msg, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return unavailable(err)
		}
		if op := msg.Headers().Get("KV-Operation"); op != "" {
			continue // a deletion or purge marker
		}
		meta, err := msg.Metadata()
		if err != nil {
			continue
		}
		out, err := rolloutProto(msg.Data())
		if err != nil {
			continue
		}
		out.Sequence = int64(meta.Sequence.Stream)
		if err := stream.Send(out); err != nil {
			return err
		}
	}
}

// GetRolloutStatus implements GET /rollout/{id}/status.
func (s *Service) GetRolloutStatus(ctx context.Context, req *rolloutv1.GetRolloutStatusRequest) (*rolloutv1.RolloutStatus, error) {
	id := req.GetRolloutId()
	if id == "" {
		return nil, fielderr.New("rollout_id", "required")
	}
	if rec := s.store.get(id); rec != nil {
		return rec.status(), nil
	}
	lc, _, err := s.sh.get(ctx, id)
	switch {
	case errors.Is(err, errGone):
		return &rolloutv1.RolloutStatus{RolloutId: id, Status: "unknown"}, nil
	case err != nil:
		return nil, unavailable(err)
	}
	return lifecycleStatus(lc), nil
}

// lifecycleStatus is status's body from a lifecycle.
func lifecycleStatus(lc *lifecycle) *rolloutv1.RolloutStatus {
	out := &rolloutv1.RolloutStatus{RolloutId: lc.ID, Status: outcome.StatusWord(lc.State), Reward: lc.Reward}
	if lc.Outcome != nil && lc.State != rolloutv1.State_STATE_GRADING {
		out.ErrMessage, out.ErrCategory = errorFields(lc.Outcome.outcome())
	}
	return out
}

// CancelRollouts implements POST /rollout/cancel: the cancel is written
// into the rollout's lifecycle (a queued one then never starts) and sent to
// the replica running it, which aborts its workflow and LLM calls.
func (s *Service) CancelRollouts(ctx context.Context, req *rolloutv1.CancelRolloutsRequest) (*rolloutv1.CancelRolloutsResponse, error) {
	if err := validateCancel(req); err != nil {
		return nil, err
	}
	out := &rolloutv1.CancelRolloutsResponse{Dispositions: map[string]string{}}
	ids := req.GetIds()
	byID := len(ids) > 0
	if !byID {
		var err error
		if ids, err = s.unfinished(ctx, req.GetPrefix()); err != nil {
			return nil, unavailable(err)
		}
	}
	// Queued rollouts go first: cancelling a running one frees a slot that
	// a queued one about to be cancelled would otherwise take.
	pending := make([]string, 0, len(ids))
	for _, queuedOnly := range []bool{true, false} {
		pending = pending[:0]
		for _, id := range ids {
			d, err := s.cancel(ctx, id, queuedOnly)
			if err != nil {
				return nil, unavailable(err)
			}
			if d == "" { // not queued: the second pass
				pending = append(pending, id)
				continue
			}
			// Every asked-for id is listed, but by prefix or all only what
			// the call stopped.
			if d != dispositionNotFound {
				out.Dispositions[id] = d
				s.log.InfoContext(ctx, "rollout cancelled", "rollout_id", id, "disposition", d)
			} else if byID {
				out.Dispositions[id] = d
			}
		}
		ids = append([]string(nil), pending...)
	}
	return out, nil
}

// cancel cancels one rollout and says what it stopped; with queuedOnly,
// one that is not queued is left alone and its disposition is "".
func (s *Service) cancel(ctx context.Context, id string, queuedOnly bool) (string, error) {
	d := dispositionNotFound
	lc, err := s.sh.update(ctx, id, func(lc *lifecycle) error {
		d = dispositionNotFound
		if lc.Cancelled || lc.Outcome != nil && lc.State != rolloutv1.State_STATE_GRADING || lc.Phase == phaseFinished || lc.Phase == phaseAdmitting {
			return errUnchanged
		}
		if queuedOnly && lc.Phase != phaseQueued {
			d = ""
			return errUnchanged
		}
		lc.Cancelled = true
		d = dispositionRunning
		if lc.Phase == phaseQueued {
			d = dispositionQueued
		}
		return nil
	})
	switch {
	case errors.Is(err, errUnchanged):
		return d, nil
	case errors.Is(err, errGone):
		return dispositionNotFound, nil
	case err != nil:
		return "", err
	}
	if d == dispositionQueued {
		// Concluded by any replica at once, not when a slot frees.
		if err := s.sh.conclude(ctx, lc); err != nil {
			return "", err
		}
	}
	if d == dispositionRunning {
		if rec := s.store.get(id); rec != nil {
			s.cancelHeld(rec)
		} else if err := s.sh.store.NC.Publish(subjectCancel, []byte(lc.ID)); err != nil {
			return "", err
		}
	}
	return d, nil
}

// cancelHeld cancels a rollout this replica holds.
func (s *Service) cancelHeld(rec *record) {
	if d := rec.cancel(); d != dispositionNotFound {
		rec.log.write("cancel", map[string]any{"disposition": d})
	}
}

// answerCancels serves the cancels sent to the replica running a rollout.
func (s *Service) answerCancels(msg *nats.Msg) {
	if rec := s.store.get(string(msg.Data)); rec != nil {
		s.cancelHeld(rec)
	}
}

// unfinished lists the ids of the cluster's unfinished rollouts whose id
// starts with prefix.
func (s *Service) unfinished(ctx context.Context, prefix string) ([]string, error) {
	w, err := s.sh.rollouts.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, err
	}
	defer w.Stop()
	var ids []string
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case e := <-w.Updates():
			if e == nil {
				return ids, nil
			}
			var lc lifecycle
			if json.Unmarshal(e.Value(), &lc) != nil || !strings.HasPrefix(lc.ID, prefix) {
				continue
			}
			if lc.Phase != phaseFinished && (lc.Outcome == nil || lc.State == rolloutv1.State_STATE_GRADING) {
				ids = append(ids, lc.ID)
			}
		}
	}
}

// Health answers the Osmosis health body: G1's for an agent loop, G3's
// (status "ok" and the concurrency) for a workflow.
func (s *Service) Health(ctx context.Context, _ *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	queued, _ := s.sh.queued(ctx) // 0 when it cannot be read
	resp := &rolloutv1.HealthResponse{
		Status:            "healthy",
		AgentLoop:         s.workflow.Name(),
		ActiveRollouts:    int32(int64(s.store.counts()) + queued),
		CompletedRollouts: int32(s.completed.Load()),
	}
	if s.cfg.AgentLoop == nil {
		resp.Status = "ok"
		resp.Concurrency = &rolloutv1.Concurrency{
			MaxConcurrent: int32(cap(s.sem)),
			Queued:        int32(queued),
			Running:       int32(s.running.Load()),
		}
	}
	return resp, nil
}

// PlatformHealth is Health behind the API key; without one the route does
// not exist.
func (s *Service) PlatformHealth(ctx context.Context, req *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	if s.cfg.APIKey == "" {
		return nil, status.Error(codes.NotFound, "Not Found")
	}
	return s.Health(ctx, req)
}
