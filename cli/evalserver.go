package cli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/osmo-rl/osmo/internal/rolloutproc"
)

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
	env := maps.Clone(s.env)
	if env == nil {
		env = map[string]string{}
	}
	maps.Copy(env, s.secrets)
	artifacts := filepath.Join(s.runDir, "rollout_trials")
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
