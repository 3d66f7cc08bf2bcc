package cli

import (
	"context"
	"flag"
	"log/slog"
	"strings"

	"github.com/osmo-rl/osmo/internal/natsstore"
)

// natsFlags say where a service keeps its shared state: an embedded NATS
// server by default (in memory, or on disk under --state), a NATS cluster
// with --nats.
type natsFlags struct {
	urls     string
	creds    string
	ca       string
	stateDir string
	sync     string
	replicas int
}

func (f *natsFlags) register(fs *flag.FlagSet, e *env) {
	fs.StringVar(&f.urls, "nats", e.getenv("OSMO_NATS_URL"), "NATS cluster holding the shared state: its `URL`s, comma-separated (nats:// or tls://; env OSMO_NATS_URL); default: a NATS server embedded in this process")
	fs.StringVar(&f.creds, "nats-creds", e.getenv("OSMO_NATS_CREDS"), "NATS credentials `FILE` (env OSMO_NATS_CREDS)")
	fs.StringVar(&f.ca, "nats-ca", e.getenv("OSMO_NATS_CA"), "CA certificate `FILE` that verifies the NATS servers of tls:// URLs (env OSMO_NATS_CA)")
	fs.StringVar(&f.stateDir, "state", e.getenv("OSMO_STATE_DIR"), "without --nats: keep the embedded server's state on disk under `DIR`, so a restart (kill -9 included) resumes it (env OSMO_STATE_DIR; default: in memory)")
	fs.StringVar(&f.sync, "state-sync", "", `with --state: "always" fsyncs every write before it is answered; a duration fsyncs that often (default 2m; see docs/deploy.md for what each survives)`)
	fs.IntVar(&f.replicas, "nats-replicas", 0, "copies of each stream and bucket in the NATS cluster (default: 3 when clustered, else 1)")
}

// open connects to the configured NATS.
func (f *natsFlags) open(ctx context.Context, name string, log *slog.Logger) (*natsstore.Store, error) {
	var urls []string
	for _, u := range strings.Split(f.urls, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	if len(urls) > 0 && f.stateDir != "" {
		return nil, usagef("--state: the state is in the NATS cluster of --nats; --state is for the embedded server only")
	}
	if f.sync != "" && f.stateDir == "" {
		return nil, usagef("--state-sync: needs --state (the in-memory store has nothing to sync)")
	}
	if f.replicas < 0 {
		return nil, usagef("--nats-replicas: must be 0 (auto) or more, got %d", f.replicas)
	}
	st, err := natsstore.Open(ctx, natsstore.Config{
		URLs: urls, CredsFile: f.creds, CAFile: f.ca, Dir: f.stateDir, Sync: f.sync,
		Replicas: f.replicas, Name: name, Logger: log,
	})
	if err != nil {
		return nil, err
	}
	log.Info("shared state", "nats", st.URL(), "replicas", st.Replicas(), "dir", f.stateDir)
	return st, nil
}
