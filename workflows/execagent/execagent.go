// Package execagent provides exec workflows: an osmo.Workflow that runs an
// external program, in any language, once per sample of a rollout, under
// the exec contract of docs/workflows.md ("Exec workflows"). The program's
// environment routes its LLM calls through the rollout's proxy and holds
// none of the server's secrets; it reads {"prompt", "metadata", "config"}
// on stdin, and its last stdout line, when it is {"messages": [...]}, is
// the sample's conversation, else the one the proxy recorded.
//
// Each run has a process group of its own, killed (SIGTERM, then SIGKILL
// after Config.KillGrace) when the rollout ends, and is contained (Limits,
// and "Containment" there): a scratch directory as its working directory
// and TMPDIR, an oom_score_adj of 1000, rlimits and, on Linux, a cgroup of
// its own. A run that hits a limit ends with a *LimitError.
package execagent

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/osmo-rl/osmo"
)

// Defaults of Config.
const (
	DefaultName            = "exec"
	DefaultMaxLineBytes    = 16 << 20
	DefaultStderrTailBytes = 4096
	DefaultKillGrace       = 2 * time.Second
)

// MaxSamples bounds Config.Samples: each sample is a process started at
// once, so a typo must not become a fork storm.
const MaxSamples = 1024

// stderrLogLineBytes is the longest stderr line passed to the logger and the
// event log; the rest of a longer line is dropped there (the tail keeps the
// raw bytes).
const stderrLogLineBytes = 4096

// Config configures an exec workflow.
type Config struct {
	// Name defaults to DefaultName. It is also the sample id (with a -N
	// suffix when Samples > 1), so it must be a valid sample id.
	osmo.AgentWorkflowConfig

	// Command is the program and its arguments (see ParseCommand for a
	// command line). Command[0] without a slash is looked up in the
	// server's PATH; a relative path with a slash is relative to Dir. An
	// argument that names an existing file under Dir (agent.js), or an
	// existing directory written with a slash (./data) or as ".", is passed
	// as its absolute path: the program runs in its scratch directory.
	Command []string `json:"command"`
	// Dir is where Command's relative paths are found; empty means the
	// server's working directory. The program itself runs in a scratch
	// directory of its own.
	Dir string `json:"dir,omitempty"`
	// ScratchDir is where each run's scratch directory (its working
	// directory and TMPDIR, removed when the run ends) is made; empty means
	// os.TempDir() ($TMPDIR, else /tmp).
	ScratchDir string `json:"scratch_dir,omitempty"`
	// Env holds extra KEY=VALUE variables. They may not set OSMO_API_KEY or
	// OPENAI_* / OSMOSIS_* variables: the contract owns those.
	Env []string `json:"env,omitempty"`
	// PassEnv names variables of the server's environment passed to the
	// program beyond the allowlist (see docs/workflows.md); NAME* is a
	// prefix. The contract's variables are never passed.
	PassEnv []string `json:"pass_env,omitempty"`
	// Limits bound each run; zero fields take DefaultLimits.
	Limits Limits `json:"limits"`
	// Samples is how many runs (samples) each rollout makes, concurrently;
	// 0 means 1.
	Samples int `json:"samples,omitempty"`
	// Settings is the "config" object given to the program on stdin; empty
	// or null means {}. It must be a JSON object.
	Settings json.RawMessage `json:"settings,omitempty"`
	// MaxLineBytes is the longest stdout line kept; longer lines are
	// skipped. 0 means DefaultMaxLineBytes.
	MaxLineBytes int `json:"max_line_bytes,omitempty"`
	// StderrTailBytes is how much of the end of stderr an ExitError
	// carries. 0 means DefaultStderrTailBytes.
	StderrTailBytes int `json:"stderr_tail_bytes,omitempty"`
	// KillGrace is how long the process group has between SIGTERM and
	// SIGKILL when the rollout's context ends, and how long output pipes
	// held open by an escaped process are drained after the program exits.
	// 0 means DefaultKillGrace.
	KillGrace time.Duration `json:"-"`
}

// UnmarshalJSON decodes data over c. The slices are detached first: a
// config copied by value (as Workflow.WithConfigJSON copies the bound one
// before laying a file over it) shares their arrays, and decoding in place
// would rewrite the original's command.
func (c *Config) UnmarshalJSON(data []byte) error {
	type config Config // no methods: no recursion
	next := config(*c)
	next.Command = slices.Clone(c.Command)
	next.Env = slices.Clone(c.Env)
	next.PassEnv = slices.Clone(c.PassEnv)
	next.Settings = slices.Clone(c.Settings)
	if err := json.Unmarshal(data, &next); err != nil {
		return err
	}
	*c = Config(next)
	return nil
}

// ConfigError is an invalid Config field. Field is its JSON name, with an
// index for list elements (env[2]).
type ConfigError struct {
	Field string
	Err   error
}

func (e *ConfigError) Error() string { return "execagent: config " + e.Field + ": " + e.Err.Error() }

func (e *ConfigError) Unwrap() error { return e.Err }

func fieldErr(field, format string, args ...any) error {
	return &ConfigError{Field: field, Err: fmt.Errorf(format, args...)}
}

// Validate checks c: the command resolves to an executable, the directory
// exists, the numbers are in range, Env leaves the contract's variables
// alone and Settings is an object. Every problem is a *ConfigError; several
// are joined.
func (c *Config) Validate() error {
	var errs []error
	name := cmp.Or(c.Name, DefaultName)
	if err := osmo.ValidSampleID(name); err != nil {
		errs = append(errs, fieldErr("name", "%w", err))
	}
	if c.Samples < 0 || c.Samples > MaxSamples {
		errs = append(errs, fieldErr("samples", "must be between 0 (one sample) and %d, got %d", MaxSamples, c.Samples))
	} else if n := c.Samples; n > 1 {
		if err := osmo.ValidSampleID(sampleID(name, n-1, n)); err != nil {
			errs = append(errs, fieldErr("name", "with samples %d: %w", n, err))
		}
	}
	for _, d := range []struct{ field, dir string }{{"dir", c.Dir}, {"scratch_dir", c.ScratchDir}} {
		if d.dir == "" {
			continue
		}
		if fi, err := os.Stat(d.dir); err != nil {
			errs = append(errs, fieldErr(d.field, "%w", err))
		} else if !fi.IsDir() {
			errs = append(errs, fieldErr(d.field, "%s is not a directory", d.dir))
		}
	}
	if _, _, err := c.resolveCommand(); err != nil {
		errs = append(errs, err)
	}
	for i, kv := range c.Env {
		key, _, ok := strings.Cut(kv, "=")
		field := fmt.Sprintf("env[%d]", i)
		switch {
		case !ok || key == "":
			errs = append(errs, fieldErr(field, "%q is not KEY=VALUE", kv))
		case strings.ContainsRune(kv, 0):
			errs = append(errs, fieldErr(field, "%s contains a NUL byte", key))
		case reservedEnv(key):
			errs = append(errs, fieldErr(field, "%s is reserved: the runner sets the OPENAI_* and OSMOSIS_* variables so that every LLM call goes through the rollout's proxy", key))
		}
	}
	for i, name := range c.PassEnv {
		if name == "" || name == "*" || strings.ContainsAny(name, "=\x00") || reservedEnv(strings.TrimSuffix(name, "*")) {
			errs = append(errs, fieldErr(fmt.Sprintf("pass_env[%d]", i), "%q is not a variable name (or NAME* prefix) the program may get", name))
		}
	}
	if u := c.Limits.User; u != nil && os.Geteuid() != 0 {
		errs = append(errs, fieldErr("limits", "user=%d:%d needs the server to run as root", u.UID, u.GID))
	} else if u != nil {
		// The program starts in its scratch directory: as another user it
		// must be able to reach it, or its start fails with a bare EACCES.
		base := cmp.Or(c.ScratchDir, os.TempDir())
		if err := reachable(base, u); err != nil {
			errs = append(errs, fieldErr("scratch_dir", "user=%d:%d runs in a directory under %s: %w; set scratch_dir (or the server's TMPDIR) to a directory that user can reach", u.UID, u.GID, base, err))
		}
	}
	if _, err := c.settings(); err != nil {
		errs = append(errs, err)
	}
	if c.MaxLineBytes < 0 {
		errs = append(errs, fieldErr("max_line_bytes", "must be 0 (default %d) or more, got %d", DefaultMaxLineBytes, c.MaxLineBytes))
	}
	if c.StderrTailBytes < 0 {
		errs = append(errs, fieldErr("stderr_tail_bytes", "must be 0 (default %d) or more, got %d", DefaultStderrTailBytes, c.StderrTailBytes))
	}
	if c.KillGrace < 0 {
		errs = append(errs, fieldErr("kill_grace", "must be 0 (default %s) or more, got %s", DefaultKillGrace, c.KillGrace))
	}
	return errors.Join(errs...)
}

// resolveCommand returns the absolute path of Command[0] and the argv the
// program gets, both resolved against Dir: the program runs in a scratch
// directory, where a relative path would name nothing. argv[0] is the path
// when Command[0] has a slash, else as written (node); the arguments are
// resolveArgs'. Node, for one, finds node_modules from the script's own
// location, so `node agent.js` in the agent's directory keeps working.
func (c *Config) resolveCommand() (path string, argv []string, err error) {
	if len(c.Command) == 0 {
		return "", nil, fieldErr("command", "is required: the program to run and its arguments")
	}
	name := c.Command[0]
	if name == "" {
		return "", nil, fieldErr("command[0]", "is empty")
	}
	base, err := filepath.Abs(c.Dir)
	if err != nil {
		return "", nil, fieldErr("dir", "%w", err)
	}
	if strings.ContainsRune(name, filepath.Separator) && !filepath.IsAbs(name) {
		name = filepath.Join(base, name)
	}
	if path, err = exec.LookPath(name); err != nil {
		return "", nil, fieldErr("command[0]", "%w", err)
	}
	if path, err = filepath.Abs(path); err != nil {
		return "", nil, fieldErr("command[0]", "%w", err)
	}
	argv = resolveArgs(base, c.Command)
	if strings.ContainsRune(argv[0], filepath.Separator) {
		argv[0] = path
	}
	return path, argv, nil
}

// resolveArgs returns args with each argument after the first that names,
// relative to base, an existing file, or an existing directory when it is
// written with a slash or is "." or "..", made absolute. A bare word that
// happens to name a directory (python3 -m agent, pytest tests) stays a
// word, as does an option (-x, --flag=path).
func resolveArgs(base string, args []string) []string {
	out := slices.Clone(args)
	for i, a := range out {
		if i == 0 || a == "" || filepath.IsAbs(a) || strings.HasPrefix(a, "-") {
			continue
		}
		p := filepath.Join(base, a)
		fi, err := os.Stat(p)
		if err != nil {
			continue
		}
		if !fi.IsDir() || a == "." || a == ".." || strings.ContainsRune(a, filepath.Separator) {
			out[i] = p
		}
	}
	return out
}

// settings returns Settings compacted, or {} when empty or null.
func (c *Config) settings() (json.RawMessage, error) {
	trimmed := bytes.TrimSpace(c.Settings)
	if len(trimmed) == 0 || string(trimmed) == "null" {
		return json.RawMessage(`{}`), nil
	}
	var buf bytes.Buffer
	if trimmed[0] != '{' || json.Compact(&buf, trimmed) != nil {
		return nil, fieldErr("settings", "must be a JSON object, got %.40q", trimmed)
	}
	return buf.Bytes(), nil
}

// reservedEnv reports whether key belongs to the contract (or is a
// credential) and so never comes from the server's environment or Env.
// Case is ignored: some clients read lowercase variants.
func reservedEnv(key string) bool {
	k := strings.ToUpper(key)
	return k == "OSMO_API_KEY" || strings.HasPrefix(k, "OPENAI_") || strings.HasPrefix(k, "OSMOSIS_")
}

// New returns the exec workflow for cfg, after Validate. Name defaults to
// DefaultName.
func New(cfg Config) (*osmo.Workflow, error) {
	cfg.Name = cmp.Or(cfg.Name, DefaultName)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return osmo.NewWorkflow[Config](runner{host: detectHost()}, &cfg)
}

// ExitError is a program that exited non-zero or died by a signal it was
// not sent for a cancelled rollout.
type ExitError struct {
	// Code is the exit status; -1 when a signal ended the program.
	Code int
	// Signal names the signal (SIGSEGV) that ended the program, if any.
	Signal string
	// StderrTail is the end of the program's stderr.
	StderrTail string
}

func (e *ExitError) Error() string {
	msg := fmt.Sprintf("program exited with status %d", e.Code)
	if e.Signal != "" {
		msg = "program killed by signal " + e.Signal
	}
	return withStderr(msg, e.StderrTail)
}

// withStderr is msg followed by the end of the program's stderr, if any.
func withStderr(msg, tail string) string {
	if tail = strings.TrimSpace(tail); tail != "" {
		return msg + "; stderr ends with:\n" + tail
	}
	return msg
}

// runner is the AgentWorkflow. Everything about a run comes from the bound
// config, so Workflow.WithConfigJSON rebinds it freely; host is what the
// machine offers to contain runs.
type runner struct{ host *host }

// Name names a workflow whose rebound config cleared Name.
func (runner) Name() string { return DefaultName }

// input is the document the program reads on stdin.
type input struct {
	Prompt   []osmo.Message  `json:"prompt"`
	Metadata map[string]any  `json:"metadata"`
	Config   json.RawMessage `json:"config"`
}

// Run implements osmo.AgentWorkflow: register every sample, then run the
// program once per sample, concurrently. The first failure cancels the
// other runs.
func (rn runner) Run(ctx context.Context, wc *osmo.WorkflowContext[Config]) error {
	if wc.Config == nil || wc.Rollout == nil {
		return errors.New("execagent: run without a config or rollout")
	}
	cfg := wc.Config
	path, argv, err := cfg.resolveCommand()
	if err != nil {
		return err
	}
	settings, err := cfg.settings()
	if err != nil {
		return err
	}
	// A rollout without a prompt or metadata still hands the program a list
	// and an object: every agent can then read them without a null check.
	in := input{Prompt: wc.Prompt, Metadata: wc.Metadata, Config: settings}
	if in.Prompt == nil {
		in.Prompt = []osmo.Message{}
	}
	if in.Metadata == nil {
		in.Metadata = map[string]any{}
	}
	var stdin bytes.Buffer
	enc := json.NewEncoder(&stdin)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(in); err != nil {
		return fmt.Errorf("execagent: encode the program's stdin: %w: %w", osmo.ErrInvalidInput, err)
	}
	rolloutID := cmp.Or(wc.RolloutID, wc.Rollout.ID)

	rn.host.logOnce(wc.Rollout.Logger(), cfg.Limits)

	n := max(cfg.Samples, 1)
	runs := make([]*sample, n)
	for i := range runs {
		id := sampleID(cmp.Or(cfg.Name, DefaultName), i, n)
		s := &sample{id: id}
		// Registered before anything starts, so a clash stops the rollout
		// before any program runs.
		if err := wc.Rollout.Register(id, s); err != nil {
			return fmt.Errorf("execagent: sample %q: %w", id, err)
		}
		runs[i] = s
	}
	spec := procSpec{
		path:      path,
		argv:      argv,
		stdin:     stdin.Bytes(),
		maxLine:   cmp.Or(cfg.MaxLineBytes, DefaultMaxLineBytes),
		tailBytes: cmp.Or(cfg.StderrTailBytes, DefaultStderrTailBytes),
		grace:     cmp.Or(cfg.KillGrace, DefaultKillGrace),
	}
	runOne := func(ctx context.Context, s *sample) error {
		ep := wc.Rollout.Endpoint(s.id)
		if ep.BaseURL == "" {
			return s.fail(fmt.Errorf("execagent: sample %q: the rollout has no LLM endpoint for it", s.id))
		}
		j, err := rn.host.newJail(cfg.Limits, cfg.ScratchDir, wc.Rollout.Logger().With("sample_id", s.id))
		if err != nil {
			return s.fail(fmt.Errorf("execagent: sample %q: contain the program: %w", s.id, err))
		}
		defer j.close()
		sp := spec
		sp.jail = j
		sp.dir = j.scratch
		sp.env = childEnv(os.Environ(), cfg.PassEnv, append(scratchEnv(j.scratch, j.lim.User != nil), cfg.Env...),
			"OPENAI_BASE_URL="+ep.BaseURL,
			"OSMOSIS_CHAT_COMPLETIONS_URL="+ep.BaseURL,
			"OPENAI_API_KEY="+ep.APIKey,
			"OSMOSIS_ROLLOUT_ID="+rolloutID,
			"OSMOSIS_SAMPLE_ID="+s.id,
			// Agents that name no model ask for the placeholder (the
			// OpenAI Agents SDK reads this), and the SDK's own tracing,
			// which would send spans and the per-rollout token to
			// OpenAI, stays off: osmo traces the rollout.
			"OPENAI_DEFAULT_MODEL="+osmo.PlaceholderModel,
			"OPENAI_AGENTS_DISABLE_TRACING=1",
		)
		return s.run(ctx, wc.Rollout, sp)
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, s := range runs {
		g.Go(func() error { return runOne(gctx, s) })
	}
	return g.Wait()
}

func sampleID(name string, i, n int) string {
	if n == 1 {
		return name
	}
	return fmt.Sprintf("%s-%d", name, i)
}

// childEnv is parent's variables that pass (allowedEnv, or named in
// pass), then extra, then contract. Later entries win (os/exec keeps the
// last of duplicate keys).
func childEnv(parent, pass, extra []string, contract ...string) []string {
	env := make([]string, 0, len(extra)+len(contract)+16)
	for _, kv := range parent {
		key, _, _ := strings.Cut(kv, "=")
		if passed(key, pass) {
			env = append(env, kv)
		}
	}
	env = append(env, extra...)
	return append(env, contract...)
}

// procSpec is one program run.
type procSpec struct {
	path string
	argv []string
	// dir is the run's scratch directory, its working directory.
	dir       string
	env       []string
	stdin     []byte
	maxLine   int
	tailBytes int
	grace     time.Duration
	logger    *slog.Logger
	jail      *jail
	// onStderr receives each stderr line, cut to stderrLogLineBytes;
	// dropped counts the bytes cut off.
	onStderr func(line string, dropped int)
}

// procResult is how a run ended.
type procResult struct {
	pid        int
	stdout     *lastLine
	stderrTail string
	// exitCode is -1 when a signal ended the program; signal names it.
	exitCode int
	signal   string
	// terminated: the context ended and the group was sent SIGTERM;
	// killed: SIGKILL followed after the grace period.
	terminated, killed bool
	// limit is the cgroup limit the run hit, if any; cpu is the leader's
	// CPU time.
	limit *LimitError
	cpu   time.Duration
}

// run runs the program for s and records its outcome on s.
func (s *sample) run(ctx context.Context, r *osmo.Rollout, spec procSpec) error {
	if err := ctx.Err(); err != nil {
		return s.fail(fmt.Errorf("execagent: sample %q: not started: %w", s.id, err))
	}
	log := r.Logger().With("sample_id", s.id)
	spec.logger = log
	spec.onStderr = func(line string, dropped int) {
		attrs := []any{"stream", "stderr", "line", line}
		if dropped > 0 {
			attrs = append(attrs, "truncated_bytes", dropped)
		}
		log.Info("agent output", attrs...)
		r.LogEvent("agent_stderr", map[string]any{"sample_id": s.id, "line": line})
	}
	start := time.Now()
	res, err := runProcess(ctx, spec)
	elapsed := time.Since(start)
	if err != nil {
		err = fmt.Errorf("execagent: sample %q: run %s: %w", s.id, spec.path, err)
		log.Error("exec agent failed", "error", err, "duration", elapsed)
		return s.fail(err)
	}
	log.Info("exec agent exited", "pid", res.pid, "exit_code", res.exitCode, "signal", res.signal,
		"duration", elapsed, "terminated", res.terminated)

	if res.limit == nil && res.exitCode != 0 {
		res.limit = signalLimit(spec.jail.lim, res.signal, res.cpu)
	}
	switch {
	case res.limit != nil:
		lerr := *res.limit
		lerr.StderrTail = res.stderrTail
		log.Warn("exec agent exceeded a limit", "limit", lerr.Limit, "value", lerr.Value, "how", lerr.How)
		err = fmt.Errorf("execagent: sample %q: %w", s.id, &lerr)
	case res.terminated:
		how := "SIGTERM"
		if res.killed {
			how = fmt.Sprintf("SIGTERM, then SIGKILL after %s", spec.grace)
		}
		err = fmt.Errorf("execagent: sample %q: %w: process group killed (%s)", s.id, ctx.Err(), how)
	case res.exitCode != 0:
		err = fmt.Errorf("execagent: sample %q: %w", s.id, &ExitError{Code: res.exitCode, Signal: res.signal, StderrTail: res.stderrTail})
	default:
		msgs, extras, perr := parseLastLine(res.stdout, spec.maxLine)
		if perr != nil {
			return s.fail(fmt.Errorf("execagent: sample %q: %w", s.id, perr))
		}
		s.succeed(msgs, extras)
		return nil
	}
	return s.fail(err)
}
