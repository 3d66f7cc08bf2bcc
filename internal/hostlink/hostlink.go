// Package hostlink connects package host to the parts of package osmo that
// only a host uses (building a rollout, running a workflow on it, reading
// what it registered), so that osmo need not export them to workflow and
// grader authors.
//
// Package osmo sets every hook below in its init function. Package host
// reads them while it is initialized, which Go orders after osmo's init since
// host imports osmo. Nothing writes them afterwards: they are wiring fixed
// at program start, not state that changes while a program runs.
//
// This package cannot import osmo (osmo imports it), so the hooks are typed
// any and their comments give their types, with osmo's types spelled out.
// Package host asserts those types when it is initialized: a hook whose type
// drifted fails every program and test that links host as it starts. The
// types that cross both ways are generic here for the same reason.
package hostlink

import (
	"log/slog"
	"time"
)

// Hooks set by package osmo's init.
var (
	// NewRollout is func(id string, rt Runtime[osmo.Endpoint]) *osmo.Rollout.
	NewRollout any
	// Sources is func(*osmo.Rollout) iter.Seq2[string, osmo.SampleSource]:
	// the registered sample sources by id, in registration order.
	Sources any
	// RunWorkflow is func(context.Context, *osmo.Workflow, *osmo.Rollout,
	// *Input[osmo.RolloutRequest]) error.
	RunWorkflow any
	// ToolsFor is func(*osmo.Workflow, *osmo.RolloutRequest) ([]osmo.Tool, error).
	ToolsFor any
	// LoopSampleID is func(*osmo.Workflow) string.
	LoopSampleID any
	// NewRolloutContext is func(r *osmo.Rollout, sampleID string,
	// req *osmo.RolloutRequest, tools []osmo.Tool) *osmo.RolloutContext.
	NewRolloutContext any
)

// RolloutKey is the context key under which the active *osmo.Rollout is
// stored: osmo reads it (RolloutFromContext), host writes it.
type RolloutKey struct{}

// Runtime is the method set of host.Runtime, with E standing for
// osmo.Endpoint. A rollout holds its host's runtime as this type.
type Runtime[E any] interface {
	Endpoint(sampleID string) E
	Logger() *slog.Logger
	LogEvent(name string, data map[string]any)
	RecordToolCall(sampleID string, latency time.Duration)
}

// Input is one rollout's input as a workflow reads it, with R standing for
// osmo.RolloutRequest. host.Input has the same fields in the same order, so
// package host converts a *host.Input to it without copying; the compiler
// refuses the conversion the day the two differ.
type Input[R any] struct {
	RolloutID string
	Prompt    []map[string]any
	Metadata  map[string]any
	Label     *string
	Request   *R
	Tools     []map[string]any
}
