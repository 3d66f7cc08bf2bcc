package rollout

import (
	"context"
	"encoding/json"
	"strings"

	"google.golang.org/grpc/status"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// maxRejectedDeliveries bounds the refused starts whose callbacks are being
// delivered at once; past it a refused start gets its 422 only.
const maxRejectedDeliveries = 64

// reportRejected tells the controller of a start refused as bad input
// through the callbacks too, as a validation_error failure: a trainer that
// only watches its callbacks must not wait forever. The caller answers 422
// at once; the callbacks follow in the background under the G2 policy, to
// each usable URL, with the request's controller_api_key when usable. id
// is the rollout id the request names, possibly empty.
//
// Nothing is posted for a caller without the server's API key, nor for a
// start naming a rollout the shared state holds (it posts its own).
func (s *Service) reportRejected(ctx context.Context, req *rolloutv1.StartRolloutRequest, id string, cause error) {
	msg := status.Convert(cause).Message()
	// A key that was itself the refused field is not sent.
	bearer := req.GetControllerApiKey()
	if strings.TrimSpace(bearer) == "" || validateHeaderValue("controller_api_key", bearer) != nil {
		bearer = ""
	}
	o := outcome.Failed(outcome.Validation, "%s", msg)
	w := &g2Wire{req: req, id: id}
	var ds []delivery
	for _, d := range append(w.ran(nil, o), w.finished(&record{}, o, o)...) {
		if validateHTTPURL(s.cfg.Outbound, "url", d.url, true) == nil {
			var err error
			if d.payload, err = json.Marshal(d.body); err != nil {
				s.log.ErrorContext(ctx, "encode callback", "event", d.event, "error", err)
				continue
			}
			d.bearer = s.seal.text(bearer) // as attempt takes it
			d.policy = s.g2Policy
			ds = append(ds, d)
		}
	}
	if len(ds) == 0 || s.auth.Authorize(ctx, rolloutv1.RolloutService_StartRollout_FullMethodName) != nil {
		return
	}
	log := s.log.With("rollout_id", id)
	if id != "" {
		if _, _, err := s.sh.get(ctx, id); err == nil {
			log.InfoContext(ctx, "refused start names a rollout the cluster holds: no callbacks for the refusal", "error", msg)
			return
		}
	}
	select {
	case s.rejectSem <- struct{}{}:
	default:
		log.WarnContext(ctx, "refused start not reported through callbacks: too many refusals being delivered", "error", msg, "limit", maxRejectedDeliveries)
		return
	}
	log.InfoContext(ctx, "start refused: reporting it through the callbacks", "error", msg)
	// The callbacks outlive the answer.
	dctx, stop := context.WithCancelCause(context.WithoutCancel(ctx))
	unbind := context.AfterFunc(s.deliverCtx, func() { stop(context.Cause(s.deliverCtx)) })
	s.wg.Go(func() {
		defer func() { <-s.rejectSem }()
		defer unbind()
		for _, d := range ds {
			s.postRetried(dctx, id, d)
		}
	})
}
