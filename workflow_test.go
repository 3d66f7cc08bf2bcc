package osmo_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

// tunedConfig is a workflow config embedding the shared part, with the kinds
// of fields a config overlay must not alias: a slice and a map.
type tunedConfig struct {
	osmo.AgentWorkflowConfig
	Temperature float64        `json:"temperature"`
	Tags        []string       `json:"tags,omitempty"`
	Limits      map[string]int `json:"limits,omitempty"`
}

// errTemperature is what tunedConfig.Validate wraps, so tests can find it
// with errors.Is through every layer of wrapping.
var errTemperature = errors.New("temperature out of range")

func (c *tunedConfig) Validate() error {
	if c.Temperature < 0 || c.Temperature > 2 {
		return fmt.Errorf("temperature: %w: must be between 0 and 2, got %v", errTemperature, c.Temperature)
	}
	return nil
}

// toolConfig is a config that declares tools itself (ToolProvider).
type toolConfig struct {
	osmo.AgentWorkflowConfig
	tools []osmo.Tool
}

func (c *toolConfig) Tools() []osmo.Tool { return c.tools }

// plainConfig is a config without an embedded AgentWorkflowConfig.
type plainConfig struct {
	N int `json:"n"`
}

// namedWorkflow names itself and may declare tools; run is its Run.
type namedWorkflow[T any] struct {
	name  string
	tools []osmo.Tool
	run   func(ctx context.Context, wc *osmo.WorkflowContext[T]) error
}

func (w namedWorkflow[T]) Name() string       { return w.name }
func (w namedWorkflow[T]) Tools() []osmo.Tool { return w.tools }

func (w namedWorkflow[T]) Run(ctx context.Context, wc *osmo.WorkflowContext[T]) error {
	if w.run == nil {
		return wc.Rollout.Register("agent", emptySource())
	}
	return w.run(ctx, wc)
}

func emptySource() osmo.SampleSource {
	return osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return nil, nil })
}

// registering is a workflow that registers one sample source and nothing
// else.
func registering[T any]() osmo.WorkflowFunc[T] {
	return func(_ context.Context, wc *osmo.WorkflowContext[T]) error {
		return wc.Rollout.Register("agent", emptySource())
	}
}

func namedTool(name string) osmo.Tool {
	return osmo.Tool{"type": "function", "function": map[string]any{"name": name}}
}

func TestNewWorkflowNaming(t *testing.T) {
	tests := []struct {
		name     string
		build    func() (*osmo.Workflow, error)
		wantName string
		wantDesc string
		wantMax  int
		wantErr  []string // substrings of the error; nil: no error
	}{
		{
			name: "embedded config",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(registering[tunedConfig](), &tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{
					Name: "tuned", Description: "a tuned agent", Concurrency: osmo.Concurrency{MaxConcurrent: 3},
				}})
			},
			wantName: "tuned", wantDesc: "a tuned agent", wantMax: 3,
		},
		{
			name: "config name wins over the Name method",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(namedWorkflow[tunedConfig]{name: "method"}, &tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "config"}})
			},
			wantName: "config",
		},
		{
			name: "Name method when the embedded name is empty",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(namedWorkflow[tunedConfig]{name: "method"}, &tunedConfig{})
			},
			wantName: "method",
		},
		{
			name: "Name method with a config of its own shape",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(namedWorkflow[plainConfig]{name: "plain"}, &plainConfig{N: 1})
			},
			wantName: "plain",
		},
		{
			name: "Name method without a config",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow[plainConfig](namedWorkflow[plainConfig]{name: "bare"}, nil)
			},
			wantName: "bare",
		},
		{
			name: "no name anywhere",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(registering[plainConfig](), &plainConfig{})
			},
			wantErr: []string{"osmo.NewWorkflow", "has no name", "embed osmo.AgentWorkflowConfig", "Name method"},
		},
		{
			name: "embedded config with an empty name and no Name method",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(registering[tunedConfig](), &tunedConfig{})
			},
			wantErr: []string{"has no name", "set Name"},
		},
		{
			name: "negative concurrency",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow(registering[tunedConfig](), &tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{
					Name: "eager", Concurrency: osmo.Concurrency{MaxConcurrent: -1},
				}})
			},
			wantErr: []string{`"eager"`, "concurrency.max_concurrent", "-1"},
		},
		{
			name: "nil workflow",
			build: func() (*osmo.Workflow, error) {
				return osmo.NewWorkflow[tunedConfig](nil, &tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "x"}})
			},
			wantErr: []string{"nil workflow"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wf, err := tt.build()
			if tt.wantErr != nil {
				if err == nil {
					t.Fatalf("NewWorkflow = %q, want an error", wf.Name())
				}
				if wf != nil {
					t.Errorf("NewWorkflow returned a workflow with its error %v", err)
				}
				for _, s := range tt.wantErr {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not mention %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("NewWorkflow: %v", err)
			}
			if wf.Name() != tt.wantName || wf.Description() != tt.wantDesc || wf.MaxConcurrent() != tt.wantMax {
				t.Errorf("name, description, max concurrent = %q, %q, %d; want %q, %q, %d",
					wf.Name(), wf.Description(), wf.MaxConcurrent(), tt.wantName, tt.wantDesc, tt.wantMax)
			}
		})
	}
}

func TestMustWorkflow(t *testing.T) {
	wf := osmo.MustWorkflow(namedWorkflow[plainConfig]{name: "ok"}, &plainConfig{})
	if wf.Name() != "ok" {
		t.Errorf("Name = %q, want ok", wf.Name())
	}
	defer func() {
		p := recover()
		err, ok := p.(error)
		if !ok || !strings.Contains(err.Error(), "has no name") {
			t.Errorf("MustWorkflow panicked with %v, want the NewWorkflow error", p)
		}
	}()
	osmo.MustWorkflow(registering[plainConfig](), &plainConfig{})
	t.Error("MustWorkflow did not panic on a workflow without a name")
}

func TestWorkflowTools(t *testing.T) {
	tests := []struct {
		name string
		wf   *osmo.Workflow
		want []string
	}{
		{
			name: "none",
			wf:   osmo.MustWorkflow(namedWorkflow[plainConfig]{name: "w"}, nil),
			want: nil,
		},
		{
			name: "workflow only",
			wf:   osmo.MustWorkflow(namedWorkflow[plainConfig]{name: "w", tools: []osmo.Tool{namedTool("a"), namedTool("b")}}, &plainConfig{}),
			want: []string{"a", "b"},
		},
		{
			name: "config only",
			wf: osmo.MustWorkflow(registering[toolConfig](), &toolConfig{
				AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "w"}, tools: []osmo.Tool{namedTool("c")},
			}),
			want: []string{"c"},
		},
		{
			name: "workflow then config",
			wf: osmo.MustWorkflow(namedWorkflow[toolConfig]{name: "w", tools: []osmo.Tool{namedTool("a")}}, &toolConfig{
				AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "w"}, tools: []osmo.Tool{namedTool("c"), namedTool("d")},
			}),
			want: []string{"a", "c", "d"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			for _, tl := range tt.wf.Tools() {
				name, err := osmo.ValidateTool(tl)
				if err != nil {
					t.Fatalf("tool %v: %v", tl, err)
				}
				got = append(got, name)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("Tools = %v, want %v", got, tt.want)
			}
			if err := tt.wf.Validate(); err != nil {
				t.Errorf("Validate: %v", err)
			}
		})
	}
}

func TestWorkflowValidate(t *testing.T) {
	badParams := osmo.Tool{"type": "function", "function": map[string]any{"name": "broken", "parameters": "nope"}}
	tests := []struct {
		name    string
		wf      *osmo.Workflow
		wantErr []string
		wantIs  error
	}{
		{
			name: "valid",
			wf: osmo.MustWorkflow(namedWorkflow[tunedConfig]{name: "w", tools: []osmo.Tool{namedTool("a")}},
				&tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "good"}, Temperature: 1}),
		},
		{
			name: "config Validate error",
			wf: osmo.MustWorkflow(registering[tunedConfig](),
				&tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "hot"}, Temperature: 7}),
			wantErr: []string{`workflow "hot"`, "invalid config", "temperature", "got 7"},
			wantIs:  errTemperature,
		},
		{
			name:    "invalid tool schema",
			wf:      osmo.MustWorkflow(namedWorkflow[plainConfig]{name: "w", tools: []osmo.Tool{namedTool("fine"), badParams}}, nil),
			wantErr: []string{`workflow "w"`, "tool 1", `"broken"`, "parameters must be a JSON Schema object"},
		},
		{
			name:    "duplicate tool",
			wf:      osmo.MustWorkflow(namedWorkflow[plainConfig]{name: "w", tools: []osmo.Tool{namedTool("twice"), namedTool("other"), namedTool("twice")}}, nil),
			wantErr: []string{`tool "twice" is declared twice`},
		},
		{
			name: "duplicate across workflow and config",
			wf: osmo.MustWorkflow(namedWorkflow[toolConfig]{name: "w", tools: []osmo.Tool{namedTool("shared")}},
				&toolConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "w"}, tools: []osmo.Tool{namedTool("shared")}}),
			wantErr: []string{`tool "shared" is declared twice`},
		},
		{
			name: "every problem at once",
			wf: osmo.MustWorkflow(namedWorkflow[tunedConfig]{name: "w", tools: []osmo.Tool{badParams, namedTool("x"), namedTool("x")}},
				&tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "all"}, Temperature: -1}),
			wantErr: []string{"invalid config", `"broken"`, `tool "x" is declared twice`},
			wantIs:  errTemperature,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.wf.Validate()
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Validate = nil, want an error")
			}
			for _, s := range tt.wantErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %q", err, s)
				}
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("errors.Is(%v, %v) = false", err, tt.wantIs)
			}
		})
	}
}

func TestWithConfigJSON(t *testing.T) {
	newBase := func() *osmo.Workflow {
		return osmo.MustWorkflow(registering[tunedConfig](), &tunedConfig{
			AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "base", Description: "the base"},
			Temperature:         1,
			Tags:                []string{"a", "b"},
			Limits:              map[string]int{"x": 1},
		})
	}
	tests := []struct {
		name     string
		data     string
		want     tunedConfig // when wantErr is nil
		wantName string
		wantErr  []string
		wantIs   error
	}{
		{
			name: "empty object keeps everything",
			data: `{}`,
			want: tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "base", Description: "the base"},
				Temperature: 1, Tags: []string{"a", "b"}, Limits: map[string]int{"x": 1}},
			wantName: "base",
		},
		{
			name: "overlay replaces slices and merges maps",
			data: `{"temperature": 0.25, "tags": ["z"], "limits": {"y": 2}}`,
			want: tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "base", Description: "the base"},
				Temperature: 0.25, Tags: []string{"z"}, Limits: map[string]int{"x": 1, "y": 2}},
			wantName: "base",
		},
		{
			name: "overlay overwrites a map key in place",
			data: `{"limits": {"x": 9}, "tags": ["c", "d", "e"]}`,
			want: tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "base", Description: "the base"},
				Temperature: 1, Tags: []string{"c", "d", "e"}, Limits: map[string]int{"x": 9}},
			wantName: "base",
		},
		{
			name: "embedded fields rename the workflow",
			data: `{"name": "renamed", "concurrency": {"max_concurrent": 2}}`,
			want: tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "renamed", Description: "the base", Concurrency: osmo.Concurrency{MaxConcurrent: 2}},
				Temperature: 1, Tags: []string{"a", "b"}, Limits: map[string]int{"x": 1}},
			wantName: "renamed",
		},
		{
			name:    "result fails the config's Validate",
			data:    `{"temperature": 9}`,
			wantErr: []string{`workflow "base"`, "invalid config", "temperature"},
			wantIs:  errTemperature,
		},
		{
			name:    "wrong field type names the config type",
			data:    `{"temperature": "hot"}`,
			wantErr: []string{`workflow "base"`, "does not decode into osmo_test.tunedConfig"},
		},
		{
			name:    "not JSON",
			data:    `temperature=1`,
			wantErr: []string{"does not decode into osmo_test.tunedConfig"},
		},
		{
			name:    "an array",
			data:    `[1, 2]`,
			wantErr: []string{"does not decode into osmo_test.tunedConfig"},
		},
		{
			name:    "a negative concurrency",
			data:    `{"concurrency": {"max_concurrent": -3}}`,
			wantErr: []string{"concurrency.max_concurrent"},
		},
		{
			// The doc promises a JSON object; a second value after it would
			// otherwise be dropped without a word.
			name:    "trailing data after the object",
			data:    `{"temperature": 0.5} {"temperature": 1.5}`,
			wantErr: []string{`workflow "base"`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			orig := newBase()
			origCfg := orig.Config().(*tunedConfig)
			before := *origCfg
			before.Tags = slices.Clone(origCfg.Tags)
			before.Limits = maps.Clone(origCfg.Limits)

			next, err := orig.WithConfigJSON([]byte(tt.data))

			// Whatever happened, the original is untouched: its config
			// value, the slice's elements and the map's entries.
			if !reflect.DeepEqual(*origCfg, before) {
				t.Errorf("original config changed to %+v, was %+v", *origCfg, before)
			}
			if orig.Name() != "base" || orig.Config().(*tunedConfig) != origCfg {
				t.Errorf("original workflow changed: name %q", orig.Name())
			}
			if tt.wantErr != nil {
				if err == nil {
					t.Fatalf("WithConfigJSON(%s) = %+v, want an error", tt.data, next.Config())
				}
				for _, s := range tt.wantErr {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not mention %q", err, s)
					}
				}
				if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
					t.Errorf("errors.Is(%v, %v) = false", err, tt.wantIs)
				}
				return
			}
			if err != nil {
				t.Fatalf("WithConfigJSON(%s): %v", tt.data, err)
			}
			if next == orig {
				t.Fatal("WithConfigJSON returned the original workflow")
			}
			got, ok := next.Config().(*tunedConfig)
			if !ok || got == origCfg {
				t.Fatalf("new config %#v is not a fresh *tunedConfig", next.Config())
			}
			if !reflect.DeepEqual(*got, tt.want) {
				t.Errorf("new config = %+v, want %+v", *got, tt.want)
			}
			if next.Name() != tt.wantName || next.MaxConcurrent() != tt.want.Concurrency.MaxConcurrent {
				t.Errorf("new workflow name %q, max concurrent %d; want %q, %d",
					next.Name(), next.MaxConcurrent(), tt.wantName, tt.want.Concurrency.MaxConcurrent)
			}
			// The new workflow runs with the new config.
			var ran *tunedConfig
			wf := osmo.MustWorkflow(osmo.WorkflowFunc[tunedConfig](func(_ context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
				ran = wc.Config
				return wc.Rollout.Register("agent", emptySource())
			}), origCfg)
			rebound, err := wf.WithConfigJSON([]byte(tt.data))
			if err != nil {
				t.Fatalf("WithConfigJSON: %v", err)
			}
			if err := osmotest.Run(t.Context(), rebound, osmotest.NewRollout("r", nil), &osmotest.Input{}); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if ran == nil || ran == origCfg || !reflect.DeepEqual(*ran, tt.want) {
				t.Errorf("Run saw config %+v, want %+v", ran, tt.want)
			}
			if !reflect.DeepEqual(*origCfg, before) {
				t.Errorf("rebinding a second workflow changed the shared config to %+v, was %+v", *origCfg, before)
			}
		})
	}
}

func TestWithConfigJSONWithoutConfig(t *testing.T) {
	wf := osmo.MustWorkflow[plainConfig](namedWorkflow[plainConfig]{name: "bare"}, nil)
	next, err := wf.WithConfigJSON([]byte(`{"n": 4}`))
	if err != nil {
		t.Fatalf("WithConfigJSON: %v", err)
	}
	if got, ok := next.Config().(*plainConfig); !ok || got.N != 4 {
		t.Errorf("Config = %#v, want &{N:4}", next.Config())
	}
	if next.Name() != "bare" {
		t.Errorf("Name = %q, want bare", next.Name())
	}
	if wf.Config() != nil {
		t.Errorf("original Config = %#v, want nil", wf.Config())
	}
}

// Config documents "the bound config (a *T), or nil": without a config a
// caller comparing it with nil must see nil, not a typed nil pointer.
func TestConfigIsNilWithoutConfig(t *testing.T) {
	wf := osmo.MustWorkflow[plainConfig](namedWorkflow[plainConfig]{name: "bare"}, nil)
	if c := wf.Config(); c != nil {
		t.Errorf("Config() = %#v, want nil", c)
	}
	cfg := &plainConfig{N: 1}
	if c := osmo.MustWorkflow(namedWorkflow[plainConfig]{name: "bound"}, cfg).Config(); c != cfg {
		t.Errorf("Config() = %#v, want the bound %p", c, cfg)
	}
}

func TestWorkflowRun(t *testing.T) {
	errAgent := errors.New("agent gave up")
	input := &osmotest.Input{
		RolloutID: "roll-1",
		Prompt:    []osmo.Message{{"role": "user", "content": "2*3?"}},
		Metadata:  map[string]any{"split": "train"},
	}
	cfg := &tunedConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "runner"}, Temperature: 1}

	t.Run("passes the input and installs the rollout", func(t *testing.T) {
		var (
			seen    *osmo.WorkflowContext[tunedConfig]
			fromCtx *osmo.Rollout
			ctxErr  error
		)
		wf := osmo.MustWorkflow(osmo.WorkflowFunc[tunedConfig](func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
			seen = wc
			fromCtx, ctxErr = osmo.RolloutFromContext(ctx)
			return wc.Rollout.Register("agent", emptySource())
		}), cfg)
		r := osmotest.NewRollout("roll-1", nil)
		if err := osmotest.Run(t.Context(), wf, r, input); err != nil {
			t.Fatalf("Run: %v", err)
		}
		if ctxErr != nil || fromCtx != r {
			t.Errorf("RolloutFromContext inside Run = %p, %v; want %p", fromCtx, ctxErr, r)
		}
		if seen.Rollout != r || seen.RolloutID != "roll-1" || seen.Config != cfg {
			t.Errorf("WorkflowContext rollout %p, id %q, config %p; want %p, roll-1, %p", seen.Rollout, seen.RolloutID, seen.Config, r, cfg)
		}
		if !reflect.DeepEqual(seen.Prompt, input.Prompt) || !reflect.DeepEqual(seen.Metadata, input.Metadata) {
			t.Errorf("prompt %v, metadata %v; want %v, %v", seen.Prompt, seen.Metadata, input.Prompt, input.Metadata)
		}
		if _, err := osmo.RolloutFromContext(t.Context()); !errors.Is(err, osmo.ErrNoRollout) {
			t.Errorf("RolloutFromContext outside Run = %v, want ErrNoRollout", err)
		}
	})

	t.Run("respects the caller's context", func(t *testing.T) {
		type key struct{}
		ctx, cancel := context.WithTimeout(context.WithValue(t.Context(), key{}, "v"), 5*time.Second)
		defer cancel()
		wf := osmo.MustWorkflow(osmo.WorkflowFunc[tunedConfig](func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
			if ctx.Value(key{}) != "v" {
				return errors.New("caller's value lost")
			}
			if _, ok := ctx.Deadline(); !ok {
				return errors.New("caller's deadline lost")
			}
			return wc.Rollout.Register("agent", emptySource())
		}), cfg)
		if err := osmotest.Run(ctx, wf, osmotest.NewRollout("r", nil), input); err != nil {
			t.Fatalf("Run: %v", err)
		}
	})

	tests := []struct {
		name     string
		run      func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error
		check    func(t *testing.T, err error)
		nSrcs    int
		noConfig bool
	}{
		{
			name: "nothing registered",
			run:  func(context.Context, *osmo.WorkflowContext[tunedConfig]) error { return nil },
			check: func(t *testing.T, err error) {
				if !errors.Is(err, osmo.ErrNoSamples) || !strings.Contains(err.Error(), `"runner"`) {
					t.Errorf("err = %v, want ErrNoSamples naming the workflow", err)
				}
			},
		},
		{
			name: "the workflow's own error, unchanged",
			run: func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
				return fmt.Errorf("step 2: %w", errAgent)
			},
			check: func(t *testing.T, err error) {
				if !errors.Is(err, errAgent) || err.Error() != "step 2: agent gave up" {
					t.Errorf("err = %v, want the workflow's error as returned", err)
				}
				if errors.Is(err, osmo.ErrNoSamples) {
					t.Errorf("err = %v also reports ErrNoSamples", err)
				}
			},
		},
		{
			name: "own error after registering",
			run: func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
				if err := wc.Rollout.Register("agent", emptySource()); err != nil {
					return err
				}
				return errAgent
			},
			check: func(t *testing.T, err error) {
				if err != errAgent {
					t.Errorf("err = %v, want errAgent itself", err)
				}
			},
			nSrcs: 1,
		},
		{
			name: "panic",
			run: func(context.Context, *osmo.WorkflowContext[tunedConfig]) error {
				panic("boom")
			},
			check: func(t *testing.T, err error) {
				pe, ok := errors.AsType[*osmo.PanicError](err)
				if !ok {
					t.Fatalf("err = %T %v, want *osmo.PanicError", err, err)
				}
				if pe.Value != "boom" || !strings.Contains(pe.Error(), "boom") {
					t.Errorf("PanicError value %v, message %q", pe.Value, pe.Error())
				}
				if !strings.Contains(string(pe.Stack), "workflow_test.go") {
					t.Errorf("PanicError stack does not point at the panic:\n%s", pe.Stack)
				}
			},
		},
		{
			name: "panic with an error value after registering",
			run: func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
				_ = wc.Rollout.Register("agent", emptySource())
				panic(errAgent)
			},
			check: func(t *testing.T, err error) {
				pe, ok := errors.AsType[*osmo.PanicError](err)
				if !ok || pe.Value != errAgent {
					t.Errorf("err = %v, want a *PanicError holding errAgent", err)
				}
			},
			nSrcs: 1,
		},
		{
			name:     "nil config",
			noConfig: true,
			run: func(ctx context.Context, wc *osmo.WorkflowContext[tunedConfig]) error {
				if wc.Config != nil {
					return fmt.Errorf("config %+v, want nil", wc.Config)
				}
				return wc.Rollout.Register("agent", emptySource())
			},
			check: func(t *testing.T, err error) {
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			},
			nSrcs: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wf := osmo.MustWorkflow(osmo.WorkflowFunc[tunedConfig](tt.run), cfg)
			if tt.noConfig {
				// Without a config the name comes from the Name method.
				wf = osmo.MustWorkflow[tunedConfig](namedWorkflow[tunedConfig]{name: "runner", run: tt.run}, nil)
			}
			r := osmotest.NewRollout("roll-1", nil)
			tt.check(t, osmotest.Run(t.Context(), wf, r, input))
			if n := len(osmotest.Sources(r)); n != tt.nSrcs {
				t.Errorf("%d sources registered, want %d", n, tt.nSrcs)
			}
		})
	}
}

// labelSeer reports the label it was given; read says whether it asks for it.
type labelSeer struct {
	read bool
	got  **string
}

func (l labelSeer) Name() string     { return "label-seer" }
func (l labelSeer) ReadsLabel() bool { return l.read }
func (l labelSeer) Run(_ context.Context, wc *osmo.WorkflowContext[struct{}]) error {
	*l.got = wc.Label
	return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return nil, nil }))
}

// TestLabelReachesOnlyLabelReaders: the row's label is in WorkflowContext
// only for a workflow that says it reads it (a hosted server's own grader
// needs it); every other workflow sees nil.
func TestLabelReachesOnlyLabelReaders(t *testing.T) {
	label := "42"
	for _, read := range []bool{true, false} {
		var got *string
		wf := osmo.MustWorkflow[struct{}](labelSeer{read: read, got: &got}, nil)
		r := osmotest.NewRollout("r", nil)
		if err := osmotest.Run(context.Background(), wf, r, &osmotest.Input{RolloutID: "r", Label: &label}); err != nil {
			t.Fatal(err)
		}
		if read && (got == nil || *got != "42") || !read && got != nil {
			t.Errorf("ReadsLabel %v: saw label %v", read, got)
		}
	}
}
