package cli

import (
	"flag"
	"time"

	"github.com/osmo-rl/osmo/services/rollout"
)

// policyFlags configure the policy's pause switch (weight updates).
type policyFlags struct {
	ackTimeout time.Duration
	heartbeat  time.Duration
}

func (f *policyFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.ackTimeout, "policy-ack-timeout", 60*time.Second, "how long POST /v1/policy/pause and /v1/policy/resume wait for every replica and its engines to apply them before answering 504 naming those that did not")
	fs.DurationVar(&f.heartbeat, "policy-heartbeat", 5*time.Second, "how often a replica rewrites its acknowledgement of the policy state; a pause does not wait for one silent for three of these")
}

func (f *policyFlags) settings() (rollout.PolicySettings, error) {
	if f.ackTimeout <= 0 {
		return rollout.PolicySettings{}, usagef("--policy-ack-timeout: must be positive, got %s", f.ackTimeout)
	}
	if f.heartbeat <= 0 {
		return rollout.PolicySettings{}, usagef("--policy-heartbeat: must be positive, got %s", f.heartbeat)
	}
	return rollout.PolicySettings{AckTimeout: f.ackTimeout, Heartbeat: f.heartbeat}, nil
}
