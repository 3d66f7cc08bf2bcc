package rollout

import (
	"context"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// This file holds the RPCs that read or steer rollouts of any wire; the
// ones that start a rollout are each wire's (g1.go, g2.go).

// GetRollout returns a rollout's current record.
func (s *Service) GetRollout(_ context.Context, req *rolloutv1.GetRolloutRequest) (*rolloutv1.Rollout, error) {
	if req.GetRolloutId() == "" {
		return nil, badField("rollout_id", "required")
	}
	rec := s.store.get(req.GetRolloutId())
	if rec == nil {
		return nil, status.Errorf(codes.NotFound, "rollout %q not found", req.GetRolloutId())
	}
	return rec.proto(), nil
}

// watchBuffer is how many finished rollouts a watcher may lag behind.
const watchBuffer = 1024

// WatchRollouts streams finished rollouts.
func (s *Service) WatchRollouts(req *rolloutv1.WatchRolloutsRequest, stream grpc.ServerStreamingServer[rolloutv1.Rollout]) error {
	if req.GetAfterSequence() < -1 {
		return badField("after_sequence", "must be -1 or more, got %d", req.GetAfterSequence())
	}
	replay, sub := s.store.subscribe(req.GetAfterSequence(), watchBuffer)
	defer s.store.unsubscribe(sub)
	last := req.GetAfterSequence()
	for _, rec := range replay {
		if err := stream.Send(rec.proto()); err != nil {
			return err
		}
		last = rec.sequence()
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case rec, ok := <-sub.ch:
			if !ok {
				return status.Errorf(codes.ResourceExhausted, "watcher fell behind; reconnect with after_sequence=%d", last)
			}
			if rec.sequence() <= last {
				continue // already replayed
			}
			if err := stream.Send(rec.proto()); err != nil {
				return err
			}
			last = rec.sequence()
		}
	}
}

// GetRolloutStatus implements GET /rollout/{id}/status.
func (s *Service) GetRolloutStatus(_ context.Context, req *rolloutv1.GetRolloutStatusRequest) (*rolloutv1.RolloutStatus, error) {
	if req.GetRolloutId() == "" {
		return nil, badField("rollout_id", "required")
	}
	rec := s.store.get(req.GetRolloutId())
	if rec == nil {
		return &rolloutv1.RolloutStatus{RolloutId: req.GetRolloutId(), Status: "unknown"}, nil
	}
	return rec.status(), nil
}

// CancelRollouts implements POST /rollout/cancel.
func (s *Service) CancelRollouts(ctx context.Context, req *rolloutv1.CancelRolloutsRequest) (*rolloutv1.CancelRolloutsResponse, error) {
	if err := validateCancel(req); err != nil {
		return nil, err
	}
	out := &rolloutv1.CancelRolloutsResponse{Dispositions: map[string]string{}}
	var recs []*record
	switch {
	case len(req.GetIds()) > 0:
		for _, id := range req.GetIds() {
			if rec := s.store.get(id); rec != nil {
				recs = append(recs, rec)
			} else {
				out.Dispositions[id] = dispositionNotFound
			}
		}
	default:
		prefix := req.GetPrefix() // "" with all
		recs = s.store.unfinished(func(id string) bool { return strings.HasPrefix(id, prefix) })
	}
	// Queued rollouts go first: cancelling a running one frees a slot that
	// a queued one about to be cancelled would otherwise take.
	queued := make([]*record, 0, len(recs))
	var others []*record
	for _, rec := range recs {
		if rec.isQueued() {
			queued = append(queued, rec)
		} else {
			others = append(others, rec)
		}
	}
	for _, rec := range append(queued, others...) {
		d := rec.cancel()
		if d == dispositionNotFound && len(req.GetIds()) == 0 {
			// By prefix or all, only what this call stopped is listed: a
			// rollout already over (still delivering its callbacks) is not.
			continue
		}
		out.Dispositions[rec.id] = d
		if d != dispositionNotFound {
			rec.log.write("cancel", map[string]any{"disposition": d})
			s.log.InfoContext(ctx, "rollout cancelled", "rollout_id", rec.id, "disposition", d)
		}
	}
	return out, nil
}

// Health answers the Osmosis health body: G1's for a server running an
// agent loop, the G3 body (status "ok" and the concurrency) for one running
// a workflow.
func (s *Service) Health(context.Context, *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	resp := &rolloutv1.HealthResponse{
		Status:            "healthy",
		AgentLoop:         s.workflow.Name(),
		ActiveRollouts:    int32(s.store.counts()),
		CompletedRollouts: int32(s.completed.Load()),
	}
	if s.cfg.AgentLoop == nil {
		limit := cap(s.sem)
		if s.wfSem != nil {
			limit = cap(s.wfSem)
		}
		resp.Status = "ok"
		resp.Concurrency = &rolloutv1.Concurrency{
			MaxConcurrent: int32(limit),
			Queued:        int32(s.queued.Load()),
			Running:       int32(s.running.Load()),
		}
	}
	return resp, nil
}

// PlatformHealth is Health behind the API key (checked by the interceptor);
// without a configured key the route does not exist.
func (s *Service) PlatformHealth(ctx context.Context, req *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	if s.cfg.APIKey == "" {
		return nil, status.Error(codes.NotFound, "Not Found")
	}
	return s.Health(ctx, req)
}
