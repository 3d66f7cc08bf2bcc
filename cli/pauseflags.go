package cli

import (
	"flag"
	"time"

	"github.com/osmo-rl/osmo/services/rollout"
)

// pauseFlags configure the policy's pause switch (weight updates).
type pauseFlags struct {
	ackTimeout   time.Duration
	heartbeat    time.Duration
	maxStaleness int64
	stale        string
}

func (f *pauseFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.ackTimeout, "policy-ack-timeout", 60*time.Second, "how long POST /v1/policy/pause and /v1/policy/resume wait for every replica and its engines to apply them before answering 504 naming those that did not")
	fs.Int64Var(&f.maxStaleness, "max-staleness", -1, "a rollout whose oldest LLM call was answered by a policy more than `K` versions behind the current one when it finishes is stale (see --stale); -1: never")
	fs.StringVar(&f.stale, "stale", rollout.StaleFlag, `what a stale rollout gets: "flag" ("stale": true on its record and rows, counted in osmo_rollouts_stale_total) or "cancel" (cancelled, error category stale_policy)`)
	fs.DurationVar(&f.heartbeat, "policy-heartbeat", 5*time.Second, "how often a replica rewrites its acknowledgement of the policy state; a pause does not wait for one silent for three of these")
}

func (f *pauseFlags) settings() (rollout.PolicySettings, error) {
	if f.ackTimeout <= 0 {
		return rollout.PolicySettings{}, usagef("--policy-ack-timeout: must be positive, got %s", f.ackTimeout)
	}
	if f.heartbeat <= 0 {
		return rollout.PolicySettings{}, usagef("--policy-heartbeat: must be positive, got %s", f.heartbeat)
	}
	s := rollout.PolicySettings{AckTimeout: f.ackTimeout, Heartbeat: f.heartbeat}
	switch {
	case f.stale != rollout.StaleFlag && f.stale != rollout.StaleCancel:
		return s, usagef("--stale: must be %q or %q, got %q", rollout.StaleFlag, rollout.StaleCancel, f.stale)
	case f.maxStaleness < -1:
		return s, usagef("--max-staleness: must be -1 (never) or more, got %d", f.maxStaleness)
	case f.maxStaleness >= 0:
		s.StaleAction, s.MaxStaleness = f.stale, f.maxStaleness
	}
	return s, nil
}
