package osmo

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"net/http"
	"regexp"
	"slices"
	"sync"
	"time"
)

// Errors of the rollout binding. The rollout service maps them to the G2
// error categories (ErrInvalidInput: validation_error; ErrTimeout: timeout;
// the rest: agent_error).
var (
	// ErrNoRollout: an integration was used outside AgentWorkflow.Run.
	ErrNoRollout = errors.New("osmo: no active rollout: build agents, models and sessions inside AgentWorkflow.Run (its ctx carries the rollout)")
	// ErrDuplicateSample: a second sample source under a name already taken.
	ErrDuplicateSample = errors.New("osmo: duplicate sample id")
	// ErrNoSamples: a workflow returned without registering a sample source.
	ErrNoSamples = errors.New("osmo: workflow returned without registering any sample source (an agent or session bound to the rollout)")
	// ErrInvalidInput marks an error caused by the rollout's input (prompt,
	// metadata, config) rather than by the agent: wrap it to have the
	// rollout fail as validation_error.
	ErrInvalidInput = errors.New("invalid input")
	// ErrTimeout marks an error of a workflow whose agent ran out of a time
	// budget of its own (a hosted rollout server's agent_timeout_sec): wrap
	// it to have the rollout fail as timeout.
	ErrTimeout = errors.New("timed out")
)

// Endpoint is where a sample's LLM calls go: an OpenAI-compatible base URL
// bound to the rollout and sample (ending in /v1; append /chat/completions),
// the bearer to send, and the headers the Osmosis controllers expect.
type Endpoint struct {
	BaseURL string
	APIKey  string
	// Headers are x-rollout-id and x-sample-id. The base URL already routes
	// by them; they are sent too so any hop can read them.
	Headers map[string]string
	// HTTPClient is the client to use (traced when tracing is on); nil means
	// the caller's default.
	HTTPClient *http.Client
}

// SampleSource is something that produced a conversation to grade: a
// session, an agent, an exec run. The rollout collects every registered
// source's sample once the workflow returned.
type SampleSource interface {
	// SampleMessages returns the conversation: each message a JSON object,
	// as it is to reach the grader and the trainer (EncodeMessages encodes
	// Messages). nil (with a nil error) stands for the conversation the LLM
	// proxy recorded for this sample: the last call's request messages
	// followed by its answer.
	SampleMessages() ([]json.RawMessage, error)
}

// SampleExtras is implemented by sources that attach extra fields to their
// sample (passed through to the trainer and the grader).
type SampleExtras interface {
	SampleExtraFields() map[string]any
}

// SampleSourceFunc adapts a function to SampleSource.
type SampleSourceFunc func() ([]json.RawMessage, error)

// SampleMessages calls f.
func (f SampleSourceFunc) SampleMessages() ([]json.RawMessage, error) { return f() }

// Rollout is the active rollout of a workflow execution: the Go face of the
// Osmosis RolloutContext. Integrations find it in the ctx passed to Run
// (RolloutFromContext), bind their LLM clients through Endpoint and register
// their conversations with Register. Its host (the rollout service, or a
// test, with package osmotest) builds it.
type Rollout struct {
	// ID is the trainer's rollout id.
	ID string

	rt      Runtime // nil: no host behind it (a test's rollout)
	mu      sync.Mutex
	sources []namedSource
}

// namedSource is a registered sample source and its sample id.
type namedSource struct {
	id  string
	src SampleSource
}

// ValidSampleID reports why id cannot be a sample id, or nil.
//
// A sample id is 1-128 characters of ^[A-Za-z0-9][A-Za-z0-9._:@+-]*$:
// usable as one URL path segment and as a JSON key, what the proxy path
// and the grader callback need.
func ValidSampleID(id string) error {
	if !sampleIDPattern.MatchString(id) {
		return fmt.Errorf("sample id %q must be 1-128 characters of letters, digits and ._:@+- starting with a letter or digit", id)
	}
	return nil
}

var sampleIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$`)

// Register adds a sample source under id. A second source under the same id
// in one rollout is an error (ErrDuplicateSample), as is an id that
// ValidSampleID refuses.
func (r *Rollout) Register(id string, src SampleSource) error {
	if err := ValidSampleID(id); err != nil {
		return fmt.Errorf("osmo: register sample source: %w", err)
	}
	if src == nil {
		return fmt.Errorf("osmo: register sample source %q: nil source", id)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.sources {
		if s.id == id {
			return fmt.Errorf("%w %q in rollout %q: every agent or session of a rollout needs its own name", ErrDuplicateSample, id, r.ID)
		}
	}
	r.sources = append(r.sources, namedSource{id: id, src: src})
	return nil
}

// registered yields the sources registered so far, in registration order.
// It reads a copy, so a source registered meanwhile does not disturb it.
func (r *Rollout) registered() iter.Seq2[string, SampleSource] {
	r.mu.Lock()
	sources := slices.Clone(r.sources)
	r.mu.Unlock()
	return func(yield func(string, SampleSource) bool) {
		for _, s := range sources {
			if !yield(s.id, s.src) {
				return
			}
		}
	}
}

// Endpoint returns where sampleID's LLM calls go.
func (r *Rollout) Endpoint(sampleID string) Endpoint {
	if r.rt == nil {
		return Endpoint{}
	}
	return r.rt.Endpoint(sampleID)
}

// RecordToolCall records one tool execution of sampleID and its latency,
// for an agent that runs its tools itself: they appear in the sample's and
// the rollout's metrics (num_tool_calls, tool_latency_ms).
func (r *Rollout) RecordToolCall(sampleID string, latency time.Duration) {
	if r.rt != nil {
		r.rt.RecordToolCall(sampleID, latency)
	}
}

// Logger is the rollout's logger, carrying rollout_id.
func (r *Rollout) Logger() *slog.Logger {
	if r.rt == nil {
		return slog.Default().With("rollout_id", r.ID)
	}
	return r.rt.Logger()
}

// LogEvent writes a debug event to the rollout's JSONL log when --log is on.
func (r *Rollout) LogEvent(name string, data map[string]any) {
	if r.rt != nil {
		r.rt.LogEvent(name, data)
	}
}

// rolloutKey is the context key of the active *Rollout.
type rolloutKey struct{}

// contextWithRollout returns ctx carrying r: the ctx a workflow runs with.
func contextWithRollout(ctx context.Context, r *Rollout) context.Context {
	return context.WithValue(ctx, rolloutKey{}, r)
}

// RolloutFromContext returns the active rollout, or ErrNoRollout.
func RolloutFromContext(ctx context.Context) (*Rollout, error) {
	if r, ok := ctx.Value(rolloutKey{}).(*Rollout); ok && r != nil {
		return r, nil
	}
	return nil, ErrNoRollout
}

// NewSampleID returns a random sample id, for sources without a name.
func NewSampleID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "sample-" + hex.EncodeToString(b[:])
}
