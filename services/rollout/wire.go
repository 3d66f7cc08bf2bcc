package rollout

import (
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/outcome"
)

// wire is the Osmosis protocol generation that started a rollout, holding
// its request.
//
// Every rollout goes through the same lifecycle, whatever its wire: it is
// admitted (admit.go), waits for a slot (queue.go), runs the workflow
// (run.go), has its samples collected (collect.go) and graded (grade.go),
// and its outcome delivered (deliver.go); lifecycle.go strings the stages
// together. A wire holds only what its generation does differently: its
// RPC handler turns the request into a record (admission and idempotency,
// where the label comes from, where the LLM calls go and with which key,
// the budgets), and the methods below say how the outcome is reported.
// One file per generation: g1.go (the remote rollout of
// /v1/rollout/init), g2.go (POST /rollout as SDK v0.2 speaks it) and
// v03.go (what today's SDK, v0.3, adds to it).
type wire interface {
	// name is the generation, for logs, spans and GetRollout: g1, g2 or
	// v0.3.
	name() string
	// statusWord is an outcome in the wire's status vocabulary (G1:
	// COMPLETED or ERROR; G2 and v0.3: success, failure or cancelled), for
	// metrics, spans and logs.
	statusWord(o outcome.Outcome) string
	// ran lists the callbacks due once the workflow has ended and its
	// samples are collected, before any grading; run is the run's outcome.
	ran(rec *record, run outcome.Outcome) []delivery
	// finished lists the callbacks due once the outcome is final: run is
	// the run's outcome, final the rollout's (they differ when grading
	// failed).
	finished(rec *record, run, final outcome.Outcome) []delivery
	// retry is the rule its callbacks are retried by (a callback read back
	// from the state log takes it from here).
	retry() callbackPolicy
	// forget drops what only running and delivering the rollout needed
	// (the request), once its record is finished.
	forget()
	// saved is what the state log keeps to rebuild the rollout after a
	// restart: its request (nil once forgotten) and, for G1, the answer
	// a duplicate init gets (resp is nil for the other wires).
	saved() (req, resp proto.Message)
}

// Wire names, as GetRollout and the telemetry report them.
const (
	wireG1  = "g1"
	wireG2  = "g2"
	wireV03 = "v0.3"
)
