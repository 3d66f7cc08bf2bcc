package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/osmo-rl/osmo/workflows/osmosisserver"
)

// osmosisFlags host an Osmosis Python rollout server as the workflow
// (--osmosis-rollout).
type osmosisFlags struct {
	dir        string
	entrypoint string
	procs      int
	// host is built once (resolve runs more than once) and started by
	// start, before the services serve.
	host *osmosisserver.Host
	log  *slog.Logger
	out  io.Writer
}

func (f *osmosisFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.dir, "osmosis-rollout", "", "serve the Osmosis rollout in `DIR` (rollouts/NAME of an Osmosis workspace, run unchanged) as the workflow, instead of --workflow; its server's reward stands unless --grader names one")
	fs.StringVar(&f.entrypoint, "entrypoint", "main.py", "with --osmosis-rollout: the rollout server's entrypoint `FILE`, in DIR")
	fs.IntVar(&f.procs, "osmosis-rollout-procs", 1, "with --osmosis-rollout: keep `N` server processes running (each restarted if it dies)")
}

// entry is the hosted rollout as the entry to serve, building its Host on
// first use.
func (f *osmosisFlags) entry() (entry, error) {
	if f.host == nil {
		if f.procs <= 0 {
			return entry{}, usagef("--osmosis-rollout-procs: must be positive, got %d", f.procs)
		}
		if fi, err := os.Stat(f.dir); err != nil || !fi.IsDir() {
			return entry{}, usagef("--osmosis-rollout: %s is not a rollout directory", f.dir)
		}
		if fi, err := os.Stat(filepath.Join(f.dir, f.entrypoint)); err != nil || fi.IsDir() {
			return entry{}, usagef("--entrypoint: %s not found in %s", f.entrypoint, f.dir)
		}
		log := f.log
		if log == nil {
			log = slog.Default()
		}
		h, err := osmosisserver.New(osmosisserver.Config{
			Dir:        f.dir,
			Entrypoint: f.entrypoint,
			Procs:      f.procs,
			Output:     f.out,
			Logger:     log,
		})
		if err != nil {
			return entry{}, usagef("--osmosis-rollout: %v", err)
		}
		f.host = h
	}
	// The server grades with its own grader: no default osmo grader.
	return entry{name: f.host.Name(), workflow: f.host.Workflow(), grader: "none"}, nil
}

// startOsmosis starts the hosted rollout's server processes, when
// --osmosis-rollout is set, and returns what stops them; their output goes
// to stderr, a line at a time.
func (f *rolloutFlags) startOsmosis(ctx context.Context, e *env, log *slog.Logger) (stop func(), err error) {
	o := &f.osmosis
	if o.dir == "" {
		return func() {}, nil
	}
	o.log, o.out = log, &stampedLines{w: e.stderr}
	if _, err := f.resolve(e); err != nil {
		return nil, err
	}
	if err := o.host.Start(ctx); err != nil {
		return nil, fmt.Errorf("--osmosis-rollout: %w", err)
	}
	f.workflow = o.host.Name()
	return func() {
		if err := o.host.Stop(context.Background()); err != nil {
			log.Warn("osmosis rollout servers stopped with an error", "error", err)
		}
	}, nil
}
