package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/osmo-rl/osmo/internal/eval"
	"github.com/osmo-rl/osmo/internal/rolloutproc"
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

// evalLogFile is the run's log: the rollout server's output, as the
// Osmosis SDK keeps it.
const evalLogFile = "logs.txt"

// startOsmosisServer starts the workspace's Osmosis rollout server for an
// eval as the SDK does: its entrypoint, in its directory, with [env], the
// secrets and the SDK's _OSMOSIS_ROLLOUT_* variables. Its output goes to
// logs.txt (and, with --verbose, stderr), secrets redacted.
func startOsmosisServer(ctx context.Context, e *env, s backendSpec, log *slog.Logger) (url string, stop func(), err error) {
	f, err := os.OpenFile(filepath.Join(s.runDir, evalLogFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return "", nil, fmt.Errorf("eval: run log: %w", err)
	}
	var out io.Writer = &stampedLines{w: f, stamp: true}
	if s.verbose {
		out = io.MultiWriter(out, e.stderr)
	}
	env := map[string]string{}
	maps.Copy(env, s.env)
	maps.Copy(env, s.secrets)
	artifacts := filepath.Join(s.runDir, eval.TrialsDir)
	if err := os.MkdirAll(artifacts, 0o755); err != nil {
		f.Close()
		return "", nil, fmt.Errorf("eval: %w", err)
	}
	srv, err := rolloutproc.Start(ctx, rolloutproc.Spec{
		Dir:          s.rolloutDir,
		Entrypoint:   s.entrypoint,
		Env:          env,
		Secrets:      s.redact.Values(),
		ArtifactRoot: artifacts,
		Output:       out,
		Logger:       log,
	})
	if err != nil {
		f.Close()
		return "", nil, usagef("the rollout server %s did not start: %v (its output is in %s)",
			filepath.Join(s.rolloutDir, s.entrypoint), err, filepath.Join(s.runDir, evalLogFile))
	}
	stop = func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := srv.Stop(ctx); err != nil {
			log.Warn("the rollout server did not stop cleanly", "err", err)
		}
		f.Close()
	}
	return srv.URL(), stop, nil
}

// stampedLines prefixes each line written (one per Write, as rolloutproc
// writes them) with the time, when stamp is set. Writes are serialized:
// several server processes may share one.
type stampedLines struct {
	mu    sync.Mutex
	w     io.Writer
	stamp bool
}

func (s *stampedLines) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	line := p
	if s.stamp {
		line = append([]byte(time.Now().UTC().Format("2006-01-02T15:04:05.000Z")+" "), p...)
	}
	if _, err := s.w.Write(line); err != nil {
		return 0, err
	}
	return len(p), nil
}
