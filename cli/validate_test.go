package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/cli"
)

// validateStubConfig is the config type of validateStub (it takes none).
type validateStubConfig struct{}

// validateStub is a user workflow that names itself and declares tools.
type validateStub struct {
	name  string
	tools []osmo.Tool
}

func (w validateStub) Name() string       { return w.name }
func (w validateStub) Tools() []osmo.Tool { return w.tools }

func (validateStub) Run(_ context.Context, wc *osmo.WorkflowContext[validateStubConfig]) error {
	return wc.Rollout.Register("stub", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return nil, nil }))
}

// withStub registers a validateStub under name.
func withStub(name string, tools ...osmo.Tool) cli.Option {
	return cli.WithWorkflow(osmo.MustWorkflow[validateStubConfig](validateStub{name: name, tools: tools}, nil), "none")
}

// brokenTool declares parameters of type "array": not a function schema.
var brokenTool = osmo.Tool{"type": "function", "function": map[string]any{
	"name": "broken", "parameters": map[string]any{"type": "array"},
}}

var goodTool = osmo.Tool{"type": "function", "function": map[string]any{
	"name": "lookup", "description": "Look a word up.",
	"parameters": map[string]any{"type": "object",
		"properties": map[string]any{"word": map[string]any{"type": "string"}},
		"required":   []any{"word"}},
}}

// writeFile writes content to a file in a fresh directory and returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// osmosisRollout is the example workspace's Osmosis rollout.
const osmosisRollout = "../examples/osmosis-workspace/rollouts/multiply"

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		args func(t *testing.T) []string
		opts []cli.Option
		// want are substrings of stdout; wantLines are whole lines of it.
		want      []string
		wantLines []string
		wantNot   []string
		wantErr   bool
	}{
		{
			name: "every built-in",
			args: func(*testing.T) []string { return nil },
			wantLines: []string{
				"ok   calculator (agent loop)",
				"ok   multiply (AgentWorkflow, tools: 1)",
			},
			wantNot: []string{"FAIL"},
		},
		{
			name: "a user workflow next to the built-ins",
			args: func(*testing.T) []string { return nil },
			opts: []cli.Option{withStub("lookup-agent", goodTool)},
			wantLines: []string{
				"ok   calculator (agent loop)",
				"ok   multiply (AgentWorkflow, tools: 1)",
				"ok   lookup-agent (AgentWorkflow, tools: 1)",
			},
			wantNot: []string{"FAIL"},
		},
		{
			name:    "two entrypoints under one name",
			args:    func(*testing.T) []string { return nil },
			opts:    []cli.Option{withStub("multiply")},
			want:    []string{"FAIL registration", "two entrypoints", `"multiply"`},
			wantNot: []string{"ok   "},
			wantErr: true,
		},
		{
			name:    "two user workflows under one name",
			args:    func(*testing.T) []string { return []string{"--workflow", "twin"} },
			opts:    []cli.Option{withStub("twin"), withStub("twin")},
			want:    []string{"two entrypoints", `"twin"`},
			wantErr: true,
		},
		{
			name:      "an invalid tool schema",
			args:      func(*testing.T) []string { return nil },
			opts:      []cli.Option{withStub("badtools", goodTool, brokenTool)},
			want:      []string{"FAIL badtools (AgentWorkflow)", `tool "broken"`, `parameters.type must be "object"`},
			wantLines: []string{"ok   calculator (agent loop)", "ok   multiply (AgentWorkflow, tools: 1)"},
			wantErr:   true,
		},
		{
			name:    "a tool declared twice",
			args:    func(*testing.T) []string { return []string{"--workflow", "twice"} },
			opts:    []cli.Option{withStub("twice", goodTool, goodTool)},
			want:    []string{"FAIL twice", `tool "lookup" is declared twice`},
			wantNot: []string{"calculator", "ok   "},
			wantErr: true,
		},
		{
			name:      "one workflow by name",
			args:      func(*testing.T) []string { return []string{"--workflow", "multiply"} },
			wantLines: []string{"ok   multiply (AgentWorkflow, tools: 1)"},
			wantNot:   []string{"calculator"},
		},
		{
			name: "a valid config override",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "multiply", "--workflow-config",
					writeFile(t, "cfg.json", `{"temperature": 0.5, "max_turns": 3, "concurrency": {"max_concurrent": 4}}`)}
			},
			wantLines: []string{"ok   multiply (AgentWorkflow, tools: 1, max_concurrent 4)"},
		},
		{
			name: "a config override out of range",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "multiply", "--workflow-config", writeFile(t, "cfg.json", `{"temperature": 9}`)}
			},
			want:    []string{"FAIL multiply", "--workflow-config", "temperature", "9"},
			wantNot: []string{"ok   "},
			wantErr: true,
		},
		{
			name: "a config field of the wrong type",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "multiply", "--workflow-config", writeFile(t, "cfg.json", `{"max_turns": "many"}`)}
			},
			want:    []string{"FAIL multiply", "multiply.Config"},
			wantErr: true,
		},
		{
			name: "a config file that is not JSON",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "multiply", "--workflow-config", writeFile(t, "cfg.json", "temperature: 0.5\n")}
			},
			want:    []string{"FAIL multiply", "is not a JSON object"},
			wantErr: true,
		},
		{
			name: "a config file that is a JSON array",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "multiply", "--workflow-config", writeFile(t, "cfg.json", `[{"temperature": 0.5}]`)}
			},
			want:    []string{"FAIL multiply", "is not a JSON object"},
			wantErr: true,
		},
		{
			name: "a config file that does not exist",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "multiply", "--workflow-config", filepath.Join(t.TempDir(), "missing.json")}
			},
			want:    []string{"FAIL multiply", "--workflow-config", "missing.json"},
			wantErr: true,
		},
		{
			name: "a config for an agent loop",
			args: func(t *testing.T) []string {
				return []string{"--workflow", "calculator", "--workflow-config", writeFile(t, "cfg.json", `{}`)}
			},
			want:    []string{"FAIL calculator", "an agent loop, which takes no config"},
			wantErr: true,
		},
		{
			name:    "an exec command that does not resolve",
			args:    func(*testing.T) []string { return []string{"--exec", "definitely-not-a-command-xyz --flag"} },
			want:    []string{"FAIL exec", "--exec", "definitely-not-a-command-xyz"},
			wantNot: []string{"ok   "},
			wantErr: true,
		},
		{
			name:      "an exec command that resolves",
			args:      func(*testing.T) []string { return []string{"--exec", "sh -c 'exit 0'"} },
			wantLines: []string{"ok   exec (AgentWorkflow, tools: 0)"},
			wantNot:   []string{"calculator", "multiply"},
		},
		{
			name:    "an exec command that does not parse",
			args:    func(*testing.T) []string { return []string{"--exec", "sh -c 'exit 0"} },
			want:    []string{"FAIL exec", "--exec"},
			wantErr: true,
		},
		{
			name:      "an Osmosis rollout directory",
			args:      func(*testing.T) []string { return []string{"--osmosis-rollout", osmosisRollout} },
			wantLines: []string{"ok   multiply (AgentWorkflow, tools: 0)"},
			wantNot:   []string{"calculator"},
		},
		{
			name: "an Osmosis rollout without its entrypoint",
			args: func(*testing.T) []string {
				return []string{"--osmosis-rollout", osmosisRollout, "--entrypoint", "server.py"}
			},
			want:    []string{"FAIL " + osmosisRollout, "--entrypoint: server.py not found"},
			wantNot: []string{"ok   "},
			wantErr: true,
		},
		{
			name:    "an unknown workflow",
			args:    func(*testing.T) []string { return []string{"--workflow", "nope"} },
			opts:    []cli.Option{withStub("mine")},
			want:    []string{"FAIL nope", `unknown workflow "nope"`, "known: calculator, mine, multiply"},
			wantErr: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"validate"}, tt.args(t)...)
			res := runCLI(t, args, tt.opts...)
			err, out := res.err, res.stdout
			if res.expired {
				t.Fatalf("Run(%q) ran into its deadline", args)
			}
			if tt.wantErr && err == nil {
				t.Errorf("Run(%q) = nil, want an error; stdout:\n%s", args, out)
			}
			if !tt.wantErr && err != nil {
				t.Errorf("Run(%q) = %v; stdout:\n%s\nstderr:\n%s", args, err, out, res.stderr)
			}
			for _, s := range tt.want {
				if !strings.Contains(out, s) {
					t.Errorf("stdout does not mention %q:\n%s", s, out)
				}
			}
			lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
			for _, l := range tt.wantLines {
				found := false
				for _, got := range lines {
					found = found || got == l
				}
				if !found {
					t.Errorf("stdout has no line %q:\n%s", l, out)
				}
			}
			for _, s := range tt.wantNot {
				if strings.Contains(out, s) {
					t.Errorf("stdout mentions %q:\n%s", s, out)
				}
			}
		})
	}
}

// The failure count in the error tells a script how much failed.
func TestValidateCountsFailures(t *testing.T) {
	res := runCLI(t, []string{"validate"},
		withStub("bad-one", brokenTool), withStub("fine", goodTool), withStub("bad-two", goodTool, goodTool))
	if res.err == nil || !strings.Contains(res.err.Error(), "2 of 5 entrypoints") {
		t.Errorf("Run = %v, want 2 of 5 entrypoints failed; stdout:\n%s", res.err, res.stdout)
	}
	if n := strings.Count("\n"+res.stdout, "\nFAIL "); n != 2 {
		t.Errorf("%d FAIL lines, want 2:\n%s", n, res.stdout)
	}
}

// cliResult is what one command line did.
type cliResult struct {
	stdout, stderr string
	err            error
	// expired: the command returned only because its deadline passed.
	expired bool
}

// runCLI runs one command line under a 10 s deadline. A panic fails the test
// with its stack instead of taking the package's other tests down with it.
func runCLI(t *testing.T, args []string, opts ...cli.Option) (res cliResult) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("Run(%q) panicked: %v\n%s", args, p, debug.Stack())
		}
	}()
	err := cli.Run(ctx, args, &stdout, &stderr, opts...)
	return cliResult{stdout: stdout.String(), stderr: stderr.String(), err: err, expired: ctx.Err() != nil}
}

// refusedAddr is an address nothing listens on: port 1 is privileged, and
// no service of a test machine uses it.
const refusedAddr = "127.0.0.1:1"

// freeAddr returns a loopback address nothing listens on right now, for
// the tests that check a failed start released it.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// serve runs the same registration check as validate, before it listens on
// anything: a duplicate name stops it at once.
func TestServeRefusesDuplicateNames(t *testing.T) {
	res := runCLI(t, []string{"serve", "-p", "0", "-H", "127.0.0.1"}, withStub("multiply"))
	if res.expired {
		t.Fatalf("serve returned only when its context ended: it started serving; err %v", res.err)
	}
	if res.err == nil {
		t.Fatal("serve with two entrypoints named multiply returned nil")
	}
	if !strings.Contains(res.err.Error(), "two entrypoints") || !strings.Contains(res.err.Error(), `"multiply"`) {
		t.Errorf("serve error %q does not name the duplicate", res.err)
	}
	if strings.Contains(res.stderr, "osmo serving") {
		t.Errorf("serve started serving:\n%s", res.stderr)
	}
}

// serve validates the workflow it is about to serve, names the problem, and
// leaves no listener behind.
func TestServeRefusesInvalidWorkflow(t *testing.T) {
	graderAddr := freeAddr(t)
	res := runCLI(t, []string{"serve", "-p", "0", "-H", "127.0.0.1", "--grader-addr", graderAddr, "--workflow", "badtools"},
		withStub("badtools", brokenTool))
	if res.expired {
		t.Fatalf("serve returned only when its context ended: it started serving; err %v", res.err)
	}
	if res.err == nil {
		t.Fatal("serve of a workflow with an invalid tool returned nil")
	}
	for _, s := range []string{`"broken"`, `parameters.type must be "object"`, "--no-validate"} {
		if !strings.Contains(res.err.Error(), s) {
			t.Errorf("serve error %q does not mention %q", res.err, s)
		}
	}
	if errors.Is(res.err, context.DeadlineExceeded) || errors.Is(res.err, context.Canceled) {
		t.Errorf("serve error %v is a context error", res.err)
	}
	ln, err := net.Listen("tcp", graderAddr)
	if err != nil {
		t.Errorf("the grader's address %s is still taken after serve gave up: %v", graderAddr, err)
		return
	}
	_ = ln.Close()
}
