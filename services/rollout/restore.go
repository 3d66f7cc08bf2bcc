package rollout

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// restore rebuilds a rollout's record from its lifecycle, as its wire's
// handler built it at admission. Past its final stage the request is gone;
// the record is then only what the callbacks and status need.
func (s *Service) restore(lc *lifecycle) (*record, error) {
	var rec *record
	switch lc.Wire {
	case wireG1:
		req := &rolloutv1.InitRolloutRequest{}
		if err := s.unmarshalRequest(lc, req); err != nil {
			return nil, err
		}
		// Past its final stage the request is gone, its id with it.
		req.RolloutId = lc.ID
		var w *g1Wire
		rec, w = s.g1Record(req, lc.Key)
		w.resp = &rolloutv1.InitRolloutResponse{}
		if err := proto.Unmarshal(lc.Response, w.resp); err != nil {
			rec.release()
			return nil, err
		}
		rec.in.Tools = fromStructs(w.resp.GetTools())
	case wireG2, wireV03:
		req, ok := lc.admitted.(*rolloutv1.StartRolloutRequest)
		if !ok {
			req = &rolloutv1.StartRolloutRequest{}
			if err := s.unmarshalRequest(lc, req); err != nil {
				return nil, err
			}
		}
		// The wire is the lifecycle's: the request that told them apart
		// may be gone.
		rec = s.g2Record(req, lc.ID, lc.Wire == wireV03)
	default:
		return nil, fmt.Errorf("unknown wire %q", lc.Wire)
	}
	rec.created = lc.Created
	rec.state = lc.State
	if !lc.Started.IsZero() {
		rec.started = lc.Started
	}
	return rec, nil
}

// unmarshalRequest decodes lc's request, sealed or not (see seal).
func (s *Service) unmarshalRequest(lc *lifecycle, req proto.Message) error {
	b, err := s.seal.open(lc.Request)
	if err != nil {
		return fmt.Errorf("rollout %s: %w", lc.ID, err)
	}
	return proto.Unmarshal(b, req)
}
