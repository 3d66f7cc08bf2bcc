// Package outcome names how a rollout, or the grading of its samples, ends:
// a state and, when it did not succeed, an error category and a message.
// The rollout and grader services share these words; each wire adapter of
// the rollout service turns them into its protocol's own (G1's COMPLETED
// and ERROR, the err_category of G2 and v0.3).
package outcome

import (
	"fmt"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// Category says why a rollout or a grading did not succeed.
type Category string

// The categories. The first four are the G2 and v0.3 wire's err_category
// values; the others are osmo's own, and Wire maps them onto those four.
const (
	// Timeout: a deadline ran out (agent_timeout_sec, grader_timeout_sec).
	Timeout Category = "timeout"
	// Validation: the input (or a grader's answer) was not acceptable.
	Validation Category = "validation_error"
	// HTTP: the policy answered an LLM call with an HTTP error.
	HTTP Category = "http_error"
	// Agent: the workflow or agent failed.
	Agent Category = "agent_error"
	// Grader: the grader could not grade (unreachable, or it failed without
	// saying why).
	Grader Category = "grader_error"
	// Cancelled: cancelled by request.
	Cancelled Category = "cancelled"
	// StalePolicy: cancelled when it finished because its oldest LLM call
	// was answered by a policy more versions behind the current one than
	// allowed (--max-staleness with --stale=cancel).
	StalePolicy Category = "stale_policy"
)

// Parse reads a category a grader reported; anything unknown is Grader.
func Parse(s string) Category {
	switch c := Category(s); c {
	case Timeout, Validation, HTTP, Agent, Grader, Cancelled:
		return c
	}
	return Grader
}

// Wire is the category as the G2 and v0.3 wires carry it in err_category:
// one of their four values, or "" for a cancellation, which their status
// ("cancelled") already says.
func (c Category) Wire() string {
	switch c {
	case Cancelled, StalePolicy, "":
		return ""
	case Grader:
		// The wires' enum has no grader category; a grading that failed
		// for want of a grader is the server's failure to produce a result.
		return string(Agent)
	}
	return string(c)
}

// Outcome is how a rollout ended.
type Outcome struct {
	// State is STATE_SUCCEEDED, STATE_FAILED or STATE_CANCELLED.
	State rolloutv1.State
	// Category and Message are empty on success.
	Category Category
	Message  string
}

// Success is the outcome of a rollout that succeeded.
func Success() Outcome { return Outcome{State: rolloutv1.State_STATE_SUCCEEDED} }

// Failed is a failure of category c.
func Failed(c Category, format string, args ...any) Outcome {
	return Outcome{State: rolloutv1.State_STATE_FAILED, Category: c, Message: fmt.Sprintf(format, args...)}
}

// CancelledBy is a cancellation by request.
func CancelledBy(format string, args ...any) Outcome {
	return Outcome{State: rolloutv1.State_STATE_CANCELLED, Category: Cancelled, Message: fmt.Sprintf(format, args...)}
}

// OK reports whether the rollout succeeded.
func (o Outcome) OK() bool { return o.State == rolloutv1.State_STATE_SUCCEEDED }

// Status is the outcome in the status vocabulary of the G3 status endpoint
// and the G2 and v0.3 completion callback: success, failure or cancelled.
func (o Outcome) Status() string { return StatusWord(o.State) }

// StatusWord names a state in the G3 vocabulary: queued, running, grading,
// success, failure, cancelled, or unknown.
func StatusWord(s rolloutv1.State) string {
	switch s {
	case rolloutv1.State_STATE_QUEUED:
		return "queued"
	case rolloutv1.State_STATE_RUNNING:
		return "running"
	case rolloutv1.State_STATE_GRADING:
		return "grading"
	case rolloutv1.State_STATE_SUCCEEDED:
		return "success"
	case rolloutv1.State_STATE_FAILED:
		return "failure"
	case rolloutv1.State_STATE_CANCELLED:
		return "cancelled"
	}
	return "unknown"
}
