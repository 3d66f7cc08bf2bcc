package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/graders"
	"github.com/osmo-rl/osmo/workflows/calculator"
	"github.com/osmo-rl/osmo/workflows/execagent"
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

// execWorkflow is the name --workflow takes for an exec workflow.
const execWorkflow = "exec"

// resolve turns the workflow flags into the entry to serve: a registered
// loop or workflow (with --workflow-config), an exec workflow, or the
// hosted Osmosis rollout.
func (f *rolloutFlags) resolve(e *env) (entry, error) {
	if err := e.reg.check(); err != nil {
		return entry{}, err
	}
	var config []byte
	if f.workflowConfig != "" {
		b, err := os.ReadFile(f.workflowConfig)
		if err != nil {
			return entry{}, usagef("--workflow-config: %v", err)
		}
		if !json.Valid(b) || !bytes.HasPrefix(bytes.TrimSpace(b), []byte("{")) {
			return entry{}, usagef("--workflow-config: %s is not a JSON object", f.workflowConfig)
		}
		config = b
	}
	if f.osmosis.dir != "" {
		if f.exec != "" || config != nil {
			return entry{}, usagef("--osmosis-rollout: not with --exec or --workflow-config")
		}
		return f.osmosis.entry()
	}
	if f.exec != "" || f.workflow == execWorkflow {
		wf, err := f.execWorkflow(config)
		if err != nil {
			return entry{}, err
		}
		// Only the user knows how to grade their agent: no default grader.
		return entry{name: wf.Name(), workflow: wf, grader: "none"}, nil
	}
	ent, err := e.reg.lookup(f.workflow)
	if err != nil {
		return entry{}, usageError{"--workflow: " + err.Error()}
	}
	if config != nil {
		if ent.workflow == nil {
			return entry{}, usagef("--workflow-config: %q is an agent loop, which takes no config", ent.name)
		}
		if ent.workflow, err = ent.workflow.WithConfigJSON(config); err != nil {
			return entry{}, usagef("--workflow-config: %v", err)
		}
	}
	return ent, nil
}

// execWorkflow builds the exec workflow: the config file's fields, then
// --exec, --exec-samples and --exec-limits over them.
func (f *rolloutFlags) execWorkflow(config []byte) (*osmo.Workflow, error) {
	var cfg execagent.Config
	if config != nil {
		dec := json.NewDecoder(bytes.NewReader(config))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&cfg); err != nil {
			return nil, usagef("--workflow-config: not an exec workflow config: %v", err)
		}
	}
	if f.exec != "" {
		argv, err := execagent.ParseCommand(f.exec)
		if err != nil {
			return nil, usagef("--exec: %v", err)
		}
		cfg.Command = argv
	}
	cfg.Env = append(cfg.Env, f.execEnv...)
	if f.execSamples != 0 {
		cfg.Samples = f.execSamples
	}
	cfg.Limits = f.execLimits.over(cfg.Limits)
	if len(cfg.Command) == 0 {
		return nil, usagef(`--workflow exec needs a command: --exec "CMD ARGS" or "command" in --workflow-config`)
	}
	wf, err := execagent.New(cfg)
	if err != nil {
		return nil, usagef("--exec: %v", err)
	}
	return wf, nil
}

// validateEntry is what `osmo validate` checks of one entrypoint: a
// workflow's config and tool schemas, or the tools a loop offers for a
// representative request.
func validateEntry(e entry) error {
	if e.workflow != nil {
		return e.workflow.Validate()
	}
	tools, err := e.loop.GetTools(&osmo.RolloutRequest{
		RolloutID:        "validate",
		Messages:         []osmo.Message{{"role": "user", "content": "validate"}},
		CompletionParams: map[string]any{},
		MaxTurns:         osmo.DefaultMaxTurns,
		MaxTokensTotal:   osmo.DefaultMaxTokensTotal,
		Metadata:         map[string]any{},
	})
	if err != nil {
		return fmt.Errorf("agent loop %q: get_tools: %w", e.name, err)
	}
	seen := map[string]bool{}
	for i, t := range tools {
		name, err := osmo.ValidateTool(t)
		if err != nil {
			return fmt.Errorf("agent loop %q: tool %d: %w", e.name, i, err)
		}
		if seen[name] {
			return fmt.Errorf("agent loop %q: tool %q is offered twice", e.name, name)
		}
		seen[name] = true
	}
	return nil
}

// runValidate is `osmo validate`: the checks `osmo serve` runs at startup,
// for every registered entrypoint or the one named.
func runValidate(_ context.Context, e *env, args []string) error {
	fs := flagSet(e, "validate")
	var f rolloutFlags
	fs.StringVar(&f.workflow, "workflow", "", "validate only this workflow (default: every registered one)")
	fs.StringVar(&f.workflowConfig, "workflow-config", "", "JSON file with the workflow's config, as for serve")
	fs.StringVar(&f.exec, "exec", "", "validate this exec workflow command, as for serve")
	fs.IntVar(&f.execSamples, "exec-samples", 0, "with --exec: samples per rollout")
	f.osmosis.register(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := e.reg.check(); err != nil {
		fmt.Fprintln(e.stdout, "FAIL registration:", err)
		return errors.New("validation failed")
	}
	var entries []entry
	if f.workflow == "" && f.exec == "" && f.workflowConfig == "" && f.osmosis.dir == "" {
		for _, name := range e.reg.order {
			entries = append(entries, e.reg.entries[name])
		}
	} else {
		if f.workflow == "" {
			f.workflow = e.reg.defaultWorkflow()
		}
		ent, err := f.resolve(e)
		if err != nil {
			name := f.workflow
			switch {
			case f.exec != "":
				name = execWorkflow
			case f.osmosis.dir != "":
				name = f.osmosis.dir
			}
			fmt.Fprintln(e.stdout, "FAIL", name+":", err)
			return errors.New("validation failed")
		}
		entries = append(entries, ent)
	}
	failed := 0
	for _, ent := range entries {
		if err := validateEntry(ent); err != nil {
			failed++
			fmt.Fprintf(e.stdout, "FAIL %s (%s): %v\n", ent.name, ent.kind(), err)
			continue
		}
		detail := ""
		if ent.workflow != nil {
			detail = fmt.Sprintf(", tools: %d", len(ent.workflow.Tools()))
			if n := ent.workflow.MaxConcurrent(); n > 0 {
				detail += fmt.Sprintf(", max_concurrent %d", n)
			}
		}
		fmt.Fprintf(e.stdout, "ok   %s (%s%s)\n", ent.name, ent.kind(), detail)
	}
	if failed > 0 {
		return fmt.Errorf("validation failed: %d of %d entrypoints", failed, len(entries))
	}
	return nil
}
