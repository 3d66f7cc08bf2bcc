package cli

import (
	"github.com/osmo-rl/osmo/workflows/execagent"
)

// execLimitsFlag is --exec-limits: the exec agents' limits in
// execagent.ParseLimits' text form, laid key by key over the workflow
// config's "limits".
type execLimitsFlag struct {
	limits execagent.Limits
	set    bool
}

func (f *execLimitsFlag) String() string {
	if f == nil {
		return ""
	}
	return f.limits.String()
}

func (f *execLimitsFlag) Set(s string) error {
	l, err := execagent.ParseLimits(s)
	if err != nil {
		return err
	}
	f.limits, f.set = l, true
	return nil
}

// over lays the flag over the config's limits.
func (f *execLimitsFlag) over(cfg execagent.Limits) execagent.Limits {
	if !f.set {
		return cfg
	}
	return cfg.Over(f.limits)
}

// execLimitsUsage is --exec-limits' usage line.
const execLimitsUsage = "limits of each exec agent run: `LIMITS` is KEY=VALUE,... of memory=SIZE, processes=N, files=N, cpu=DURATION, file-size=SIZE, user=UID[:GID], none turning one off " +
	"(default memory=2GiB,processes=512,files=4096,file-size=1GiB; laid over the config's \"limits\"; see docs/workflows.md)"
