package grader

import (
	"errors"
	"fmt"
	"log/slog"
	"sort"
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
	// Default is the grader for requests that name none; it must be a key of
	// Graders. Empty means requests must name their grader.
	Default string
	// Timeout bounds one grader run (150s, the Osmosis grader_timeout_s).
	// Time spent waiting for a MaxConcurrent slot does not count.
	Timeout time.Duration
	// MaxConcurrent gradings run at once across all requests (64); it also
	// bounds the requests one GradeStream has in progress, so a client that
	// sends faster than the graders answer is slowed by flow control.
	MaxConcurrent int
	// State is the NATS JetStream that keeps the gradings, in the bucket
	// "osmo_gradings". Required. Every Service on the same NATS (replicas,
	// or a Service started again) answers a resent sample from the
	// grading any of them stored. The caller owns it: Close leaves it open.
	State *natsstore.Store
	// ResultTTL is how long a grading is remembered, and so how long a
	// resent sample (same ids, same content) is answered without grading it
	// again (1h). It is also the bucket's TTL, so the Services sharing a
	// NATS should agree on it: the last one started sets it.
	ResultTTL time.Duration
	// Logger receives structured logs (slog.Default()).
	Logger *slog.Logger
	// Metrics, when set, receives the service's Prometheus collectors.
	Metrics prometheus.Registerer
	// TracerProvider, when set, traces every request: a "grade" span
	// parented on the request's trace_context (or the call's own trace for
	// Grade), and a "run_grader {name}" span around each grader run.
	TracerProvider trace.TracerProvider
	// Propagator reads GradeRequest.trace_context (W3C trace context and
	// baggage when nil).
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
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

func (c *Config) graderNames() []string {
	names := make([]string, 0, len(c.Graders))
	for n := range c.Graders {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
