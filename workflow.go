package osmo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"runtime/debug"
)

// Concurrency bounds how many executions of a workflow run at once.
type Concurrency struct {
	// MaxConcurrent executions; 0 means no limit of the workflow's own (the
	// server's --max-concurrent still applies).
	MaxConcurrent int `json:"max_concurrent,omitempty"`
}

// AgentWorkflowConfig is the part every workflow config shares. Embed it in a
// config type to give the workflow its name, description and concurrency:
//
//	type SearchConfig struct {
//		osmo.AgentWorkflowConfig
//		MaxIterations int `json:"max_iterations"`
//	}
type AgentWorkflowConfig struct {
	// Name identifies the workflow. Required.
	Name        string      `json:"name"`
	Description string      `json:"description,omitempty"`
	Concurrency Concurrency `json:"concurrency,omitzero"`
}

// base lets NewWorkflow find an embedded AgentWorkflowConfig.
func (c *AgentWorkflowConfig) base() *AgentWorkflowConfig { return c }

type workflowConfig interface{ base() *AgentWorkflowConfig }

// AgentWorkflow produces behaviour for one dataset row: the Go face of the
// Osmosis AgentWorkflow, generic over its config type T. Run is called once
// per rollout; it builds its agents inside, routes every LLM call through the
// rollout (see Rollout.Endpoint and the integrations), and registers each
// conversation that should be graded as a sample source. It must be safe for
// concurrent use: one value serves every rollout.
type AgentWorkflow[T any] interface {
	Run(ctx context.Context, wc *WorkflowContext[T]) error
}

// WorkflowFunc adapts a function to AgentWorkflow.
type WorkflowFunc[T any] func(ctx context.Context, wc *WorkflowContext[T]) error

// Run calls f.
func (f WorkflowFunc[T]) Run(ctx context.Context, wc *WorkflowContext[T]) error { return f(ctx, wc) }

// WorkflowContext is what one execution of a workflow works on.
type WorkflowContext[T any] struct {
	// RolloutID is the trainer's id for this rollout.
	RolloutID string
	// Prompt is the dataset row's input messages.
	Prompt []Message
	// Config is the workflow's config; nil when none was given.
	Config *T
	// Metadata is the row's metadata column; nil when the row has none. The
	// row's label (ground truth) is never here: only graders see it.
	Metadata map[string]any
	// Label is the row's label, set only for workflows that grade inside
	// themselves and say so (LabelReader); nil for every other workflow.
	Label *string
	// Rollout is the active rollout (also in ctx: RolloutFromContext).
	Rollout *Rollout
}

// LabelReader is implemented by an AgentWorkflow whose samples are graded
// by a grader of its own rather than by osmo's: a hosted Osmosis rollout
// server grades inside the server, and its grader needs the row's label.
// Only such a workflow sees WorkflowContext.Label; agents written for osmo
// never do, so the ground truth cannot leak into a prompt by accident.
type LabelReader interface {
	ReadsLabel() bool
}

// workflowInput is one rollout's input: its prompt, metadata and label, and
// for a remote rollout (G1) the trainer's request and the tools offered for
// it.
type workflowInput struct {
	RolloutID string
	Prompt    []Message
	Metadata  map[string]any
	Label     *string
	Request   *RolloutRequest
	Tools     []Tool
}

// ToolProvider is implemented by workflows (or their configs) that declare
// the function tools they offer, so `osmo validate` can check the schemas.
type ToolProvider interface {
	Tools() []Tool
}

// ConfigValidator is implemented by configs that check themselves; `osmo
// validate` and Workflow.WithConfigJSON call it.
type ConfigValidator interface {
	Validate() error
}

// Workflow is an AgentWorkflow bound to its config, type-erased so the
// rollout service, registries and `osmo validate` can hold any of them.
// Build one with NewWorkflow; the rollout service (or a test, with package
// osmotest) runs it.
type Workflow struct {
	name        string
	description string
	concurrency int
	tools       []Tool
	config      any // *T, possibly nil
	validate    func() error
	run         func(ctx context.Context, r *Rollout, in *workflowInput) error
	rebind      func(data []byte) (*Workflow, error)
	// loop is the agent loop behind an AgentLoopWorkflow, and loopSample
	// the id of its one sample; nil and "" otherwise.
	loop       RolloutAgentLoop
	loopSample string
}

// NewWorkflow binds w to config (nil for none). The name, description and
// concurrency come from an AgentWorkflowConfig embedded in T; a workflow
// whose config has none (or no config) names itself with a Name() method.
func NewWorkflow[T any](w AgentWorkflow[T], config *T) (*Workflow, error) {
	if w == nil {
		return nil, errors.New("osmo.NewWorkflow: nil workflow")
	}
	wf := &Workflow{}
	if config != nil {
		// Only a non-nil *T goes into the interface: Config() must be a
		// plain nil without one.
		wf.config = config
		if c, ok := any(config).(workflowConfig); ok {
			b := c.base()
			wf.name, wf.description, wf.concurrency = b.Name, b.Description, b.Concurrency.MaxConcurrent
		}
	}
	if wf.name == "" {
		if n, ok := any(w).(interface{ Name() string }); ok {
			wf.name = n.Name()
		}
	}
	if wf.name == "" {
		return nil, fmt.Errorf("osmo.NewWorkflow: %T has no name: embed osmo.AgentWorkflowConfig in its config and set Name, or give it a Name method", w)
	}
	if wf.concurrency < 0 {
		return nil, fmt.Errorf("osmo.NewWorkflow: workflow %q: concurrency.max_concurrent must be 0 (no limit) or more, got %d", wf.name, wf.concurrency)
	}
	if tp, ok := any(w).(ToolProvider); ok {
		wf.tools = append(wf.tools, tp.Tools()...)
	}
	if config != nil {
		if tp, ok := any(config).(ToolProvider); ok {
			wf.tools = append(wf.tools, tp.Tools()...)
		}
	}
	wf.validate = func() error {
		if config == nil {
			return nil
		}
		if v, ok := any(config).(ConfigValidator); ok {
			return v.Validate()
		}
		return nil
	}
	lr, readsLabel := any(w).(LabelReader)
	readsLabel = readsLabel && lr.ReadsLabel()
	wf.run = func(ctx context.Context, r *Rollout, in *workflowInput) error {
		wc := &WorkflowContext[T]{
			RolloutID: in.RolloutID,
			Prompt:    in.Prompt,
			Config:    config,
			Metadata:  in.Metadata,
			Rollout:   r,
		}
		if readsLabel {
			wc.Label = in.Label
		}
		return w.Run(ctx, wc)
	}
	wf.rebind = func(data []byte) (*Workflow, error) {
		next := new(T)
		if config != nil {
			// Start from the current config so a file may set only some
			// fields. A JSON round trip copies it deeply: decoding into a
			// shallow copy would write into the original's slices and maps.
			// Fields without a JSON name start from their zero value.
			cur, err := json.Marshal(config)
			if err != nil {
				return nil, fmt.Errorf("encode the current config: %w", err)
			}
			if err := json.Unmarshal(cur, next); err != nil {
				return nil, fmt.Errorf("copy the current config: %w", err)
			}
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		if err := dec.Decode(next); err != nil {
			return nil, fmt.Errorf("config does not decode into %s: %w", reflect.TypeFor[T](), err)
		}
		if _, err := dec.Token(); err != io.EOF {
			return nil, fmt.Errorf("config for %s: unexpected data after the JSON object", reflect.TypeFor[T]())
		}
		return NewWorkflow(w, next)
	}
	return wf, nil
}

// MustWorkflow is NewWorkflow that panics on error, for package-level
// registrations whose failure is a programming error.
func MustWorkflow[T any](w AgentWorkflow[T], config *T) *Workflow {
	wf, err := NewWorkflow(w, config)
	if err != nil {
		panic(err)
	}
	return wf
}

// Name is the workflow's name: the entrypoint name it is served under and
// the default sample id prefix.
func (w *Workflow) Name() string { return w.name }

// Description is the config's description, if any.
func (w *Workflow) Description() string { return w.description }

// MaxConcurrent is the workflow's own concurrency limit (0: none).
func (w *Workflow) MaxConcurrent() int { return w.concurrency }

// Tools are the tools the workflow declares (ToolProvider), for validation.
func (w *Workflow) Tools() []Tool { return w.tools }

// toolsFor is Hosting().ToolsFor: an agent loop's GetTools (a panic becomes an
// error), or the tools the workflow declares.
func (w *Workflow) toolsFor(req *RolloutRequest) (tools []Tool, err error) {
	if w.loop == nil {
		return w.tools, nil
	}
	defer func() {
		if p := recover(); p != nil {
			tools, err = nil, fmt.Errorf("get_tools panicked: %v", p)
		}
	}()
	tools, err = w.loop.GetTools(req)
	if err != nil {
		return nil, fmt.Errorf("get_tools failed: %w", err)
	}
	return tools, nil
}

// Config is the bound config (a *T), or nil.
func (w *Workflow) Config() any { return w.config }

// WithConfigJSON returns the workflow bound to the config decoded from data
// (a JSON object, laid over the current config), validated.
func (w *Workflow) WithConfigJSON(data []byte) (*Workflow, error) {
	next, err := w.rebind(data)
	if err != nil {
		return nil, fmt.Errorf("workflow %q: %w", w.name, err)
	}
	if err := next.validate(); err != nil {
		return nil, fmt.Errorf("workflow %q: invalid config: %w", next.name, err)
	}
	return next, nil
}

// Validate checks what can be checked before serving: the config's own
// Validate and every declared tool's schema.
func (w *Workflow) Validate() error {
	var errs []error
	if err := w.validate(); err != nil {
		errs = append(errs, fmt.Errorf("invalid config: %w", err))
	}
	seen := map[string]bool{}
	for i, t := range w.tools {
		name, err := ValidateTool(t)
		if err != nil {
			errs = append(errs, fmt.Errorf("tool %d: %w", i, err))
			continue
		}
		if seen[name] {
			errs = append(errs, fmt.Errorf("tool %q is declared twice", name))
		}
		seen[name] = true
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("workflow %q: %w", w.name, err)
	}
	return nil
}

// execute is Hosting().Run: it runs the workflow for one rollout with r
// installed in ctx. A panic becomes an error; so does returning without
// registering any sample source (ErrNoSamples): an empty success would
// train on nothing.
func (w *Workflow) execute(ctx context.Context, r *Rollout, in *workflowInput) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	if err := w.run(contextWithRollout(ctx, r), r, in); err != nil {
		return err
	}
	r.mu.Lock()
	n := len(r.sources)
	r.mu.Unlock()
	if n == 0 {
		return fmt.Errorf("workflow %q: %w", w.name, ErrNoSamples)
	}
	return nil
}

// PanicError is a workflow (or agent loop) panic turned into an error.
type PanicError struct {
	Value any
	Stack []byte
	// what panicked, for the message: "workflow" when empty.
	what string
}

func (e *PanicError) Error() string {
	what := e.what
	if what == "" {
		what = "workflow"
	}
	return fmt.Sprintf("%s panicked: %v", what, e.Value)
}
