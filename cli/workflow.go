package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/workflows/execagent"
)

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
