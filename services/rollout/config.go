package rollout

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/netguard"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// ClientSettings are the OSMOSIS_ROLLOUT_CLIENT_* settings: how the service
// talks to the trainer (LLM calls and the G1 completion). The Osmosis
// COMPLETE_ROLLOUT_RETRIES has no field: every callback is retried until
// CallbackSettings.Deadline instead.
type ClientSettings struct {
	Timeout                 time.Duration // per HTTP attempt (300s)
	MaxRetries              int           // LLM call retries (3)
	RetryBaseDelay          time.Duration // 1s
	RetryMaxDelay           time.Duration // 30s
	MaxConnections          int           // 100
	MaxKeepaliveConnections int           // 100 (the Osmosis SDK's: 20)
}

// DefaultClientSettings are the Osmosis defaults, but for the idle
// connections kept per host: as many as the pool opens (the SDK keeps 20
// of 100), or every call over that many in flight closes its connection and
// the next opens one.
func DefaultClientSettings() ClientSettings {
	return ClientSettings{
		Timeout:                 300 * time.Second,
		MaxRetries:              3,
		RetryBaseDelay:          time.Second,
		RetryMaxDelay:           30 * time.Second,
		MaxConnections:          100,
		MaxKeepaliveConnections: 100,
	}
}

// CallbackSettings is how callbacks are delivered: transient failures are
// retried until Deadline after the first attempt (15m), G2 and v0.3
// callbacks BaseDelay doubling up to MaxDelay apart, each bounded by
// Timeout (0.5s, 8s, 10s: the Osmosis SDK's; the G1 completion takes the
// ClientSettings'). At most MaxInFlight are open at once (64).
type CallbackSettings struct {
	BaseDelay   time.Duration
	MaxDelay    time.Duration
	Timeout     time.Duration
	Deadline    time.Duration
	MaxInFlight int
}

// DefaultCallbackConcurrency is how many callback requests are open at
// once by default.
const DefaultCallbackConcurrency = 64

// DefaultMaxRecordBytes bounds the finished records by default.
const DefaultMaxRecordBytes = 256 << 20

// DefaultLostAfter is how long a lost replica's rollouts wait before
// another replica concludes them.
const DefaultLostAfter = 30 * time.Second

// DefaultDeliveryDeadline is how long a callback is retried by default.
const DefaultDeliveryDeadline = 15 * time.Minute

// Config configures a Service. Zero values take the documented defaults.
type Config struct {
	// Workflow runs every rollout, whatever wire started it.
	Workflow *osmo.Workflow
	// AgentLoop, instead of Workflow, runs every rollout as
	// osmo.AgentLoopWorkflow makes it one; /health then answers G1's body.
	AgentLoop osmo.RolloutAgentLoop
	// MaxQueued rollouts may wait for a slot (MaxConcurrent); beyond that
	// StartRollout answers 429 (G1 inits, which have no 429, are unbound).
	MaxQueued int
	Callbacks CallbackSettings
	// Grader grades finished samples; nil disables grading.
	Grader Grader
	// GraderName is the grader spec asked of the grader service ("" = its default).
	GraderName string
	// APIKey, when set, is required as a bearer on every RPC but Health.
	APIKey string

	// MaxConcurrent rollouts run at once; the rest queue (100).
	MaxConcurrent int
	// RecordTTL keeps finished rollouts for lookups and idempotency (1h).
	RecordTTL time.Duration
	// MaxRecordBytes bounds what finished records hold (256 MiB), the
	// oldest dropped first.
	MaxRecordBytes int64
	// RolloutTimeout bounds one workflow run (600s), a G2 or v0.3
	// rollout's from its acceptance, unless agent_timeout_sec says otherwise.
	RolloutTimeout time.Duration
	// GradeTimeout bounds grading unless grader_timeout_sec says otherwise
	// (150s).
	GradeTimeout time.Duration
	// DrainTimeout is how long shutdown waits for running rollouts before
	// cancelling them, and again for their callbacks (10s).
	DrainTimeout time.Duration
	// MaxMetadataBytes limits the encoded metadata of an init (1 MiB).
	MaxMetadataBytes int
	// Client holds the trainer-facing HTTP settings (zero:
	// DefaultClientSettings).
	Client ClientSettings

	// Model, when set, replaces the placeholder model on upstream calls.
	Model string
	// Rows counts each finished rollout's training rows (metrics, span
	// events); off, the proxy does not ask the policy for tokens. Unlike
	// the other fields its zero value is not the default: the CLI turns
	// rows on unless --training-rows=false.
	Rows bool
	// PolicyVocabSize, when positive, is the policy's vocabulary size: a
	// recorded token id at or above it makes its call a row problem. Zero
	// means unknown (no engine reports it in a standard answer), and then
	// only negative ids are.
	PolicyVocabSize int
	// ProxyAddr is where the embedded LLM proxy listens (127.0.0.1:0).
	ProxyAddr string
	// State is the NATS JetStream holding the state every replica shares;
	// nil is an embedded server in memory, owned by the Service.
	State *natsstore.Store
	// LostAfter is how long a lost replica's rollouts wait before another
	// replica concludes them (30s).
	LostAfter time.Duration
	// FinalWait is how long a graded rollout waits for its first stage's
	// callbacks to be tried before it owes its final stage in a write of its
	// own, rather than with the first stage's mark (1s).
	FinalWait time.Duration
	// ReplicaName names this replica in the shared state (the host name).
	ReplicaName string
	// LogDir enables per-rollout JSONL event logs (the --log flag).
	LogDir string
	// Logger receives structured logs (slog.Default()).
	Logger *slog.Logger
	// HTTPClient overrides the client used for callbacks, as given (Outbound
	// does not apply to it).
	HTTPClient *http.Client
	// Outbound is which addresses the service may connect to on a trainer's
	// behalf (the policy and the callbacks), checked at each dial and, for
	// IP literals, at admission; nil is netguard.Default().
	Outbound *netguard.Policy
	// Metrics, when set, receives the service's and the embedded LLM
	// proxy's Prometheus collectors.
	Metrics prometheus.Registerer

	// TracerProvider, when set, traces every rollout: a "rollout" span under
	// the call that started it, with the agent run, grading and callbacks
	// inside. Nil means no tracing and no cost.
	TracerProvider trace.TracerProvider
	// ProxyTracerProvider traces the embedded LLM proxy (TracerProvider when
	// nil).
	ProxyTracerProvider trace.TracerProvider
	// Propagator carries the trace between the services (W3C trace context
	// and baggage when nil).
	Propagator propagation.TextMapPropagator
	// TraceContent records LLM messages on the proxy's chat spans.
	TraceContent bool

	// Engines, when set, are the policy engines the embedded proxy spreads
	// LLM calls over (llmproxy.Config.Engines): the calls of rollouts whose
	// wire names no policy URL (chat_completions_url may then be left
	// out), and every call with EnginesOwnRouting. Serve runs them.
	Engines           *llmproxy.Engines
	EnginesOwnRouting bool
	// Policy configures the policy's pause switch for weight updates
	// (policy.go).
	Policy PolicySettings
}

func (c *Config) setDefaults() error {
	if (c.AgentLoop == nil) == (c.Workflow == nil) {
		return errors.New("rollout: Config needs a Workflow or an AgentLoop, one of them")
	}
	orDefault(&c.MaxConcurrent, 100)
	orDefault(&c.MaxQueued, c.MaxConcurrent)
	orDefault(&c.Callbacks.Deadline, DefaultDeliveryDeadline)
	orDefault(&c.Callbacks.BaseDelay, 500*time.Millisecond)
	orDefault(&c.Callbacks.MaxDelay, 8*time.Second)
	orDefault(&c.Callbacks.Timeout, 10*time.Second)
	orDefault(&c.Callbacks.MaxInFlight, DefaultCallbackConcurrency)
	orDefault(&c.RecordTTL, time.Hour)
	orDefault(&c.RolloutTimeout, 600*time.Second)
	orDefault(&c.GradeTimeout, 150*time.Second)
	orDefault(&c.DrainTimeout, 10*time.Second)
	orDefault(&c.MaxMetadataBytes, 1<<20)
	orDefault(&c.MaxRecordBytes, DefaultMaxRecordBytes)
	orDefault(&c.LostAfter, DefaultLostAfter)
	orDefault(&c.FinalWait, time.Second)
	orDefault(&c.Policy.AckTimeout, 60*time.Second)
	orDefault(&c.Policy.Heartbeat, 5*time.Second)
	switch c.Policy.StaleAction {
	case "", StaleFlag, StaleCancel:
	default:
		return fmt.Errorf("rollout: Policy.StaleAction must be %q, %q or empty, got %q", StaleFlag, StaleCancel, c.Policy.StaleAction)
	}
	if c.Policy.MaxStaleness < 0 {
		return fmt.Errorf("rollout: Policy.MaxStaleness must not be negative, got %d", c.Policy.MaxStaleness)
	}
	if c.LostAfter < time.Second {
		return errors.New("rollout: LostAfter must be at least 1s")
	}
	d := DefaultClientSettings()
	if c.Client == (ClientSettings{}) {
		c.Client = d
	}
	orDefault(&c.Client.Timeout, d.Timeout)
	c.Client.MaxRetries = max(c.Client.MaxRetries, 0)
	orDefault(&c.Client.RetryBaseDelay, d.RetryBaseDelay)
	orDefault(&c.Client.RetryMaxDelay, d.RetryMaxDelay)
	orDefault(&c.Client.MaxConnections, d.MaxConnections)
	orDefault(&c.Client.MaxKeepaliveConnections, d.MaxKeepaliveConnections)
	c.ProxyAddr = cmp.Or(c.ProxyAddr, "127.0.0.1:0")
	c.Logger = cmp.Or(c.Logger, slog.Default())
	if c.Propagator == nil {
		c.Propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	if c.ProxyTracerProvider == nil {
		c.ProxyTracerProvider = c.TracerProvider
	}
	return nil
}

// orDefault sets *v to d unless it is positive.
func orDefault[T int | int64 | time.Duration](v *T, d T) {
	if *v <= 0 {
		*v = d
	}
}
