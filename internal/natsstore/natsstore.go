// Package natsstore connects osmo's services to the NATS JetStream that
// holds their shared state: the rollout service's admissions, work queue,
// lifecycle records, outbox and finished records, and the grader's
// idempotency. A process without a NATS URL embeds the server (no
// listener, reached in memory), so a single process and a fifty-pod
// deployment run the same code against the same engine.
package natsstore

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/retry"
)

// Sync settings of the embedded server's file storage.
const (
	// SyncAlways fsyncs every write before it is acknowledged.
	SyncAlways = "always"
	// DefaultSyncInterval is how often the embedded server fsyncs its files
	// by default (NATS's own default).
	DefaultSyncInterval = 2 * time.Minute
)

// DefaultMaxPayload is the largest message the embedded server takes: a
// finished record carries every sample's messages and recorded calls.
const DefaultMaxPayload = 8 << 20

// Config says which NATS to use.
type Config struct {
	// URLs of a NATS cluster (nats:// or tls://). None: an embedded server.
	URLs []string
	// CredsFile is a NATS credentials file (user JWT and seed).
	CredsFile string
	// CAFile verifies the servers' TLS certificates (tls:// URLs).
	CAFile string
	// Dir, for the embedded server, keeps JetStream's files there (file
	// storage, surviving a restart); empty keeps everything in memory.
	Dir string
	// Sync, for the embedded server with a Dir: SyncAlways, or an fsync
	// interval as a duration ("" is DefaultSyncInterval).
	Sync string
	// Replicas each stream and bucket keeps; 0 picks 3 when the server is
	// part of a cluster and 1 otherwise.
	Replicas int
	// Name names the connection in the server's monitoring.
	Name string
	// Timeout bounds each JetStream request (5s).
	Timeout time.Duration
	// StartTimeout bounds waiting for JetStream at start (1m): for its
	// first answer in Open, and for each Setup.
	StartTimeout time.Duration
	// Logger receives connection events.
	Logger *slog.Logger
}

// Store is a connection to JetStream, and the embedded server behind it
// when there is one.
type Store struct {
	NC       *nats.Conn
	JS       jetstream.JetStream
	replicas int
	storage  jetstream.StorageType
	srv      *server.Server
	tmpDir   string
	log      *slog.Logger
	url      string
	// startTimeout is Config.StartTimeout.
	startTimeout time.Duration
	// closing is set by Close: a disconnection after it is not news.
	closing atomic.Bool
	// closed is closed by the connection's last callback, once it is closed.
	closed chan struct{}
}

// Open connects to cfg's NATS, starting the embedded server first when no
// URL is given. A cluster that cannot be reached is an error naming it.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = time.Minute
	}
	s := &Store{log: cfg.Logger, storage: jetstream.FileStorage, closed: make(chan struct{}), startTimeout: cfg.StartTimeout}
	opts := []nats.Option{
		nats.Name(cfg.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.PingInterval(5 * time.Second),
		nats.MaxPingsOutstanding(3),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if !s.closing.Load() {
				cfg.Logger.Warn("nats: disconnected; reconnecting", "error", err)
			}
		}),
		nats.ClosedHandler(func(nc *nats.Conn) {
			if !s.closing.Load() {
				cfg.Logger.Error("nats: connection closed for good; the shared state is out of reach", "error", nc.LastError())
			}
			close(s.closed)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			cfg.Logger.Info("nats: reconnected", "url", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			cfg.Logger.Warn("nats", "error", err)
		}),
	}
	var url string
	if len(cfg.URLs) == 0 {
		if err := s.embed(cfg); err != nil {
			return nil, err
		}
		opts = append(opts, nats.InProcessServer(s.srv))
		s.url = "embedded"
	} else {
		url = strings.Join(cfg.URLs, ",")
		s.url = url
		if cfg.CredsFile != "" {
			opts = append(opts, nats.UserCredentials(cfg.CredsFile))
		}
		if cfg.CAFile != "" {
			opts = append(opts, nats.RootCAs(cfg.CAFile))
		}
		opts = append(opts, nats.Timeout(cfg.Timeout))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		s.shutdown()
		return nil, fmt.Errorf("natsstore: cannot reach NATS at %s: %w", s.url, err)
	}
	js, err := jetstream.New(nc, jetstream.WithDefaultTimeout(cfg.Timeout))
	if err != nil {
		nc.Close()
		s.shutdown()
		return nil, fmt.Errorf("natsstore: %w", err)
	}
	s.NC, s.JS = nc, js
	// A cluster electing its JetStream leader (a node restarting) answers
	// late; a server without JetStream says so at once.
	if err := s.Setup(ctx, "account info", func(ctx context.Context) error {
		_, err := js.AccountInfo(ctx)
		return err
	}); err != nil {
		s.Close()
		return nil, fmt.Errorf("natsstore: NATS at %s has no JetStream for this account: %w", s.url, err)
	}
	s.replicas = cfg.Replicas
	if s.replicas <= 0 {
		s.replicas = 1
		if nc.ConnectedClusterName() != "" {
			s.replicas = 3
		}
	}
	return s, nil
}

func (s *Store) embed(cfg Config) error {
	opts := &server.Options{
		ServerName: "osmo-embedded",
		JetStream:  true,
		DontListen: true,
		NoSigs:     true,
		NoLog:      true,
		MaxPayload: DefaultMaxPayload,
		StoreDir:   cfg.Dir,
	}
	if cfg.Dir == "" {
		// Memory streams write nothing, but the server wants a directory.
		dir, err := os.MkdirTemp("", "osmo-nats-")
		if err != nil {
			return fmt.Errorf("natsstore: %w", err)
		}
		s.tmpDir, opts.StoreDir = dir, dir
		s.storage = jetstream.MemoryStorage
	} else {
		if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
			return fmt.Errorf("natsstore: state dir: %w", err)
		}
		switch cfg.Sync {
		case "":
			opts.SyncInterval = DefaultSyncInterval
		case SyncAlways:
			opts.SyncAlways = true
		default:
			d, err := time.ParseDuration(cfg.Sync)
			if err != nil || d <= 0 {
				return fmt.Errorf("natsstore: sync: want %q or a positive duration, got %q", SyncAlways, cfg.Sync)
			}
			opts.SyncInterval = d
		}
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		s.shutdown()
		return fmt.Errorf("natsstore: embedded server: %w", err)
	}
	s.srv = srv
	srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		s.shutdown()
		return errors.New("natsstore: the embedded server did not start within 30s")
	}
	return nil
}

// URL is what the store is connected to ("embedded" for the embedded server).
func (s *Store) URL() string { return s.url }

// Embedded reports whether the server runs in this process.
func (s *Store) Embedded() bool { return s.srv != nil }

// Private reports whether the state is this process's alone: an embedded
// server without a state directory keeps it in this process's memory,
// where no other process reaches it and which it does not outlive.
func (s *Store) Private() bool {
	return s.srv != nil && s.storage == jetstream.MemoryStorage
}

// Replicas is how many copies each stream and bucket keeps.
func (s *Store) Replicas() int { return s.replicas }

// Close drains the connection and stops the embedded server.
func (s *Store) Close() error {
	if s == nil {
		return nil
	}
	s.closing.Store(true)
	if s.NC != nil {
		_ = s.NC.Drain()
		s.NC.Close()
		// The connection's callbacks, which log, run on a goroutine of its
		// own: wait for the last, so that none runs after Close returns.
		select {
		case <-s.closed:
		case <-time.After(closeWait):
			s.log.Warn("natsstore: the connection's callbacks did not end in time", "waited", closeWait)
		}
	}
	s.shutdown()
	return nil
}

// closeWait bounds how long Close waits for the connection's callbacks.
const closeWait = 5 * time.Second

func (s *Store) shutdown() {
	if s.srv != nil {
		s.srv.Shutdown()
		s.srv.WaitForShutdown()
	}
	if s.tmpDir != "" {
		_ = os.RemoveAll(s.tmpDir)
	}
}

// Setup runs step, one step of setting the shared state up (asking for
// the account, looking up or creating a bucket, a stream or a consumer),
// until it succeeds, fails for good, or StartTimeout has passed. A cluster
// that has just formed, or is electing a leader, does not answer in time
// or answers that it is not ready (see NotReady): such a step is tried
// again, 100 ms doubling to 2 s apart. A step must be safe to repeat (a
// timed-out create may have been made). Each try's requests are bounded by
// the request timeout unless ctx has a deadline of its own.
func (s *Store) Setup(ctx context.Context, what string, step func(context.Context) error) error {
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		err := step(ctx)
		if err != nil && !NotReady(err) {
			return struct{}{}, backoff.Permanent(err)
		}
		return struct{}{}, err
	},
		backoff.WithBackOff(retry.SharedState()),
		backoff.WithMaxElapsedTime(s.startTimeout),
		backoff.WithNotify(func(err error, wait time.Duration) {
			s.log.Warn("natsstore: JetStream is not ready; retrying", "step", what, "error", err, "wait", wait)
		}))
	return err
}

// NotReady reports whether err is what a JetStream that is starting
// answers: no answer in time, no responders, a 5xx API error (leader being
// elected, resources not yet known), or no peers to place the replicas on
// yet. A server or account without JetStream is not "not ready".
func NotReady(err error) bool {
	if errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
		return false
	}
	if Unavailable(err) {
		return true
	}
	var api *jetstream.APIError
	return errors.As(err, &api) && (api.Code >= 500 || api.ErrorCode == errCodeNoSuitablePeers)
}

// errCodeNoSuitablePeers is JetStream's "no suitable peers for placement"
// (JSClusterNoPeersErr): a cluster whose nodes have not all met yet cannot
// place a stream's replicas.
const errCodeNoSuitablePeers jetstream.ErrorCode = 10005

// KeyValue creates (or updates to cfg) a bucket with the store's storage
// and replicas.
func (s *Store) KeyValue(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	cfg.Storage, cfg.Replicas = s.storage, s.replicas
	kv, err := s.JS.CreateOrUpdateKeyValue(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("natsstore: bucket %s: %w", cfg.Bucket, err)
	}
	return kv, nil
}

// Stream creates (or updates to cfg) a stream with the store's storage and
// replicas.
func (s *Store) Stream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	cfg.Storage, cfg.Replicas = s.storage, s.replicas
	st, err := s.JS.CreateOrUpdateStream(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("natsstore: stream %s: %w", cfg.Name, err)
	}
	return st, nil
}

// Key encodes an id (any string) as a KV key and subject token: base64url
// without padding, whose alphabet NATS takes in both.
func Key(id string) string {
	if id == "" {
		return "_"
	}
	return base64.RawURLEncoding.EncodeToString([]byte(id))
}

// ID decodes a Key.
func ID(key string) (string, error) {
	if key == "_" {
		return "", nil
	}
	b, err := base64.RawURLEncoding.DecodeString(key)
	return string(b), err
}

// Unavailable reports whether err means NATS could not be reached or did
// not answer in time (as opposed to a refusal).
func Unavailable(err error) bool {
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, jetstream.ErrJetStreamNotEnabled)
}
