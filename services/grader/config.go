package grader

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/natsstore"
)

// Defaults of Config.
const (
	DefaultTimeout       = 150 * time.Second
	DefaultMaxConcurrent = 64
	DefaultResultTTL     = time.Hour
)

// Config configures a Service. Zero values take the documented defaults.
type Config struct {
	// Graders are the graders requests may name. Required: at least one.
	Graders map[string]osmo.Grader
	// Default, a key of Graders, grades requests that name none; empty
	// means requests must name their grader.
	Default string
	// Timeout bounds one grader run, not counting the wait for a slot (150s,
	// the Osmosis grader_timeout_s).
	Timeout time.Duration
	// MaxConcurrent gradings run at once (64); it also bounds the requests
	// one GradeStream has in progress, so flow control slows a client that
	// sends faster than the graders answer.
	MaxConcurrent int
	// State is the NATS JetStream whose bucket "osmo_gradings" keeps the
	// gradings every Service on it shares. Required; Close leaves it open.
	State *natsstore.Store
	// ResultTTL is how long a grading answers resends of its samples (1h).
	// It is the bucket's TTL too: the last Service started on a NATS sets it.
	ResultTTL time.Duration
	// Logger receives structured logs (slog.Default()).
	Logger *slog.Logger
	// Metrics, when set, receives the service's Prometheus collectors.
	Metrics prometheus.Registerer
	// TracerProvider, when set, traces every request ("grade") and grader
	// run ("run_grader {name}").
	TracerProvider trace.TracerProvider
	// Propagator reads trace_context (W3C trace context and baggage when nil).
	Propagator propagation.TextMapPropagator
}

func (c *Config) setDefaults() error {
	if len(c.Graders) == 0 {
		return errors.New("Config.Graders: at least one grader is required")
	}
	for name, g := range c.Graders {
		if name == "" {
			return errors.New("Config.Graders: a grader has an empty name")
		}
		if g == nil {
			return fmt.Errorf("Config.Graders: grader %q is nil", name)
		}
	}
	if c.Default != "" {
		if _, ok := c.Graders[c.Default]; !ok {
			return fmt.Errorf("Config.Default: unknown grader %q (known: %s)", c.Default, strings.Join(c.graderNames(), ", "))
		}
	}
	if c.Timeout < 0 || c.MaxConcurrent < 0 || c.ResultTTL < 0 {
		return errors.New("Config.Timeout, MaxConcurrent and ResultTTL must not be negative")
	}
	if c.State == nil {
		return errors.New("Config.State: required: the NATS JetStream that keeps the gradings (natsstore.Open)")
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.MaxConcurrent == 0 {
		c.MaxConcurrent = DefaultMaxConcurrent
	}
	if c.ResultTTL == 0 {
		c.ResultTTL = DefaultResultTTL
	}
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return nil
}

func (c *Config) graderNames() []string { return slices.Sorted(maps.Keys(c.Graders)) }
