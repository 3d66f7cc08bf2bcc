package cli

import (
	"context"

	"github.com/osmo-rl/osmo/internal/planebench"
)

// runBenchPlane is `osmo bench plane`: the proxy in front of several
// engines against the single-upstream proxy, affinity and balance under a
// skewed load, and an engine killed in the middle of a run.
func runBenchPlane(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "bench plane")
	cfg, d := planebench.Config{Plane: planebench.NewPlane}, planebench.Defaults()
	fs.IntVar(&cfg.Requests, "n", d.Requests, "requests per setup in the latency runs")
	fs.IntVar(&cfg.Clients, "clients", d.Clients, "clients sending at once in the latency runs")
	fs.IntVar(&cfg.Samples, "samples", d.Samples, "samples in the skewed run (1 in 10 long)")
	fs.IntVar(&cfg.SkewClients, "skew-clients", d.SkewClients, "agents playing samples at once in the skewed run")
	fs.IntVar(&cfg.LongCalls, "long-calls", d.LongCalls, "calls of a long sample in the skewed run (a short one makes 2)")
	fs.IntVar(&cfg.Rollouts, "rollouts", d.Rollouts, "rollouts in the run whose engine is killed")
	fs.IntVar(&cfg.KillEngines, "kill-engines", d.KillEngines, "engines in the run whose engine is killed")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	switch {
	case cfg.Requests < 100:
		return usagef("-n: at least 100 requests are needed for a p99, got %d", cfg.Requests)
	case cfg.Clients < 1:
		return usagef("--clients must be at least 1, got %d", cfg.Clients)
	case cfg.SkewClients < 1:
		return usagef("--skew-clients must be at least 1, got %d", cfg.SkewClients)
	case cfg.Samples < 10:
		return usagef("--samples must be at least 10 (one in ten is long), got %d", cfg.Samples)
	case cfg.LongCalls < 2:
		return usagef("--long-calls must be at least 2, got %d", cfg.LongCalls)
	case cfg.Rollouts < 1:
		return usagef("--rollouts must be at least 1, got %d", cfg.Rollouts)
	case cfg.KillEngines < 2:
		return usagef("--kill-engines must be at least 2 (one dies, another takes its calls), got %d", cfg.KillEngines)
	}
	rep, err := planebench.Measure(ctx, cfg)
	if err != nil {
		return err
	}
	rep.WriteTable(e.stdout)
	return nil
}
