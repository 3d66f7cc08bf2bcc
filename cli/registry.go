package cli

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/workflows/calculator"
	"github.com/osmo-rl/osmo/workflows/multiply"
)

// Option adds user code to the binary built around Main.
type Option func(*registry)

// WithAgentLoop registers an agent loop under its Name; it serves every
// wire, as osmo.AgentLoopWorkflow makes it a workflow. defaultGrader is the
// grader spec used when --grader is not given ("" or "none": the loop's
// own reward stands).
func WithAgentLoop(loop osmo.RolloutAgentLoop, defaultGrader string) Option {
	return func(r *registry) {
		r.add(entry{name: loop.Name(), loop: loop, grader: defaultGrader})
	}
}

// WithWorkflow registers an AgentWorkflow (osmo.NewWorkflow) under its
// Name; defaultGrader is as for WithAgentLoop.
func WithWorkflow(wf *osmo.Workflow, defaultGrader string) Option {
	return func(r *registry) {
		if wf == nil {
			r.errs = append(r.errs, errors.New("WithWorkflow: nil workflow"))
			return
		}
		r.add(entry{name: wf.Name(), workflow: wf, grader: defaultGrader})
	}
}

// WithGrader registers a grader under name, next to the built-in ones.
func WithGrader(name string, g osmo.Grader) Option {
	return func(r *registry) { r.graders[name] = g }
}

// entry is one registered entrypoint: an agent loop or a workflow.
type entry struct {
	name     string
	loop     osmo.RolloutAgentLoop
	workflow *osmo.Workflow
	grader   string
}

func (e entry) kind() string {
	if e.workflow != nil {
		return "AgentWorkflow"
	}
	return "agent loop"
}

// registry is what one binary can run: built-ins plus the user's.
type registry struct {
	entries map[string]entry
	order   []string
	graders map[string]osmo.Grader
	// errs are registration mistakes, reported by `osmo validate` and
	// refused by the serving commands.
	errs []error
}

// builtins is how many entries newRegistry registers itself.
const builtins = 2

func newRegistry(opts []Option) *registry {
	r := &registry{entries: map[string]entry{}, graders: map[string]osmo.Grader{}}
	WithAgentLoop(calculator.Loop{}, "calculator")(r)
	WithWorkflow(multiply.New(), "multiply")(r)
	for _, o := range opts {
		o(r)
	}
	return r
}

func (r *registry) add(e entry) {
	if old, ok := r.entries[e.name]; ok {
		r.errs = append(r.errs, fmt.Errorf("two entrypoints are registered under the name %q (a %s and a %s): every workflow needs its own name", e.name, old.kind(), e.kind()))
		return
	}
	r.entries[e.name] = e
	r.order = append(r.order, e.name)
}

func (r *registry) check() error { return errors.Join(r.errs...) }

func (r *registry) lookup(name string) (entry, error) {
	e, ok := r.entries[name]
	if !ok {
		return entry{}, fmt.Errorf("unknown workflow %q (known: %s)", name, strings.Join(slices.Sorted(maps.Keys(r.entries)), ", "))
	}
	return e, nil
}

// defaultWorkflow is the first registered user entry, else calculator.
func (r *registry) defaultWorkflow() string {
	if len(r.order) > builtins {
		return r.order[builtins]
	}
	return r.order[0]
}

// grader resolves a spec: a user grader by name, else a built-in spec
// ("name" or "name:key=value,...").
func (r *registry) grader(spec string) (osmo.Grader, error) {
	if g, ok := r.graders[spec]; ok {
		return g, nil
	}
	g, err := graders.Lookup(spec)
	if err != nil && len(r.graders) > 0 {
		return nil, fmt.Errorf("%w (registered: %s)", err, strings.Join(slices.Sorted(maps.Keys(r.graders)), ", "))
	}
	return g, err
}

// graderSet is every grader a grader service offers: built-ins, the user's,
// and the resolved default spec under its own name.
func (r *registry) graderSet(defaultSpec string) (map[string]osmo.Grader, error) {
	set := map[string]osmo.Grader{}
	for _, name := range graders.Names() {
		g, err := graders.Lookup(name)
		if err != nil {
			return nil, err
		}
		set[name] = g
	}
	maps.Copy(set, r.graders)
	if defaultSpec != "" {
		g, err := r.grader(defaultSpec)
		if err != nil {
			return nil, err
		}
		set[defaultSpec] = g
	}
	return set, nil
}
