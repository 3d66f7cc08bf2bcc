package rollout

import (
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/outcome"
)

// wire is the Osmosis protocol generation that started a rollout, holding
// its request: what its generation does differently. Its RPC handler turns
// the request into a record (idempotency, the label, where the LLM calls go
// and with which key, the budgets); the methods say how the outcome is
// reported.
type wire interface {
	// name is the generation: g1, g2 or v0.3.
	name() string
	// statusWord is an outcome in the wire's status vocabulary (G1:
	// COMPLETED or ERROR; G2 and v0.3: success, failure or cancelled).
	statusWord(o outcome.Outcome) string
	// ran lists the callbacks due once the run ended and its samples are
	// collected, before any grading.
	ran(rec *record, run outcome.Outcome) []delivery
	// finished lists the callbacks due once the outcome is final (final
	// differs from run when grading failed).
	finished(rec *record, run, final outcome.Outcome) []delivery
	// forget drops the request once the record is finished.
	forget()
	// saved is what the lifecycle keeps to rebuild the rollout: its
	// request (nil once forgotten) and, for G1, the init's answer.
	saved() (req, resp proto.Message)
}

// Wire names, as GetRollout and the telemetry report them.
const (
	wireG1  = "g1"
	wireG2  = "g2"
	wireV03 = "v0.3"
)
