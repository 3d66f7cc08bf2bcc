package cli

import (
	"fmt"
	"sort"
	"strings"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

// Option adds user code to the binary built around Main.
type Option func(*registry)

// WithAgentLoop registers a remote-rollout agent loop under its Name.
// defaultGrader is the grader spec used when --grader is not given ("" or
// "none" for no grading: the loop's own reward stands).
func WithAgentLoop(loop osmo.RolloutAgentLoop, defaultGrader string) Option {
	return func(r *registry) {
		r.loops[loop.Name()] = loopEntry{loop: loop, grader: defaultGrader}
		r.order = append(r.order, loop.Name())
	}
}

// WithGrader registers a grader under name, next to the built-in ones.
func WithGrader(name string, g osmo.Grader) Option {
	return func(r *registry) { r.graders[name] = g }
}

type loopEntry struct {
	loop   osmo.RolloutAgentLoop
	grader string
}

// registry is what one binary can run: built-ins plus the user's.
type registry struct {
	loops   map[string]loopEntry
	order   []string
	graders map[string]osmo.Grader
}

func newRegistry(opts []Option) *registry {
	r := &registry{loops: map[string]loopEntry{}, graders: map[string]osmo.Grader{}}
	WithAgentLoop(calculator.Loop{}, "calculator")(r)
	for _, o := range opts {
		o(r)
	}
	return r
}

func (r *registry) loop(name string) (loopEntry, error) {
	e, ok := r.loops[name]
	if !ok {
		names := make([]string, 0, len(r.loops))
		for n := range r.loops {
			names = append(names, n)
		}
		sort.Strings(names)
		return loopEntry{}, fmt.Errorf("unknown workflow %q (known: %s)", name, strings.Join(names, ", "))
	}
	return e, nil
}

// defaultWorkflow is the first registered user loop, else calculator.
func (r *registry) defaultWorkflow() string {
	if len(r.order) > 1 {
		return r.order[1]
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
	if err != nil {
		user := make([]string, 0, len(r.graders))
		for n := range r.graders {
			user = append(user, n)
		}
		sort.Strings(user)
		if len(user) > 0 {
			return nil, fmt.Errorf("%w (registered: %s)", err, strings.Join(user, ", "))
		}
		return nil, err
	}
	return g, nil
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
	for name, g := range r.graders {
		set[name] = g
	}
	if defaultSpec != "" {
		g, err := r.grader(defaultSpec)
		if err != nil {
			return nil, err
		}
		set[defaultSpec] = g
	}
	return set, nil
}
