// Package eval is osmo's local evaluation loop: it reads an Osmosis eval
// TOML (either generation) and a dataset, drives every row through a
// rollout server over the v0.3 wire as a training cluster's controller
// does, journals each result durably, and summarises the run as the
// Osmosis platform does, in summary.json and a report a person can read.
package eval

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/BurntSushi/toml"

	"github.com/osmo-rl/osmo/internal/rows"
)

// Config generations: the file an Osmosis project holds is one or the
// other, and both are in use.
const (
	// GenerationCurrent is today's file (SDK v0.3): [experiment],
	// [evaluation], [env], [secrets], [advanced].
	GenerationCurrent = "v0.3"
	// GenerationV02 is the SDK v0.2-era file: [eval], [llm], [runs],
	// [timeouts], [output].
	GenerationV02 = "v0.2"
)

// Config is an eval TOML of either generation, read into one shape.
type Config struct {
	Experiment Experiment
	Evaluation Evaluation
	LLM        LLM
	// Env is [env]: variables handed to the rollout's process.
	Env map[string]string
	// Secrets is [secrets] required: the names of variables whose values
	// come from --secrets-file or the environment, never from the file.
	Secrets []string
	// Advanced is [advanced]: recorded in the manifest, not used locally
	// (as the SDK's eval run).
	Advanced map[string]any
	// Fresh and RetryFailed are the v0.2 [eval] switches (flags too).
	Fresh, RetryFailed bool
	// Output is the v0.2 [output] section.
	Output Output
	// Rows is osmo's [rows] section, read in either generation.
	Rows Rows
	// Generation is GenerationCurrent or GenerationV02.
	Generation string
	// Path is the file the config was read from.
	Path string
}

// Experiment says what runs: the rollout, the model and the dataset.
type Experiment struct {
	// Rollout is a rollout of the workspace (rollouts/NAME), a workflow
	// registered in this binary, or "exec".
	Rollout string `toml:"rollout"`
	// Entrypoint is the rollout server's file in rollouts/NAME (main.py
	// when empty), or the agent command when Rollout is "exec".
	Entrypoint string `toml:"entrypoint"`
	// ModelPath is "provider/model" (LiteLLM style): calls to the
	// placeholder model go to the model, named without an "openai/" prefix.
	ModelPath string `toml:"model_path"`
	// Dataset is a dataset file (relative to the config's directory or the
	// workspace), or the name of one under the workspace's data/.
	Dataset string `toml:"dataset"`
	// Grader is a grader spec (osmo's key); empty means the workflow's own.
	Grader string `toml:"grader"`
	// Branch and CommitSHA pin the source on the platform; a local run
	// records them and runs the workspace as it is.
	Branch    string `toml:"branch"`
	CommitSHA string `toml:"commit_sha"`
}

// Evaluation says how much runs and how it is judged.
type Evaluation struct {
	// Limit takes the first rows only (0: all); Offset skips rows first
	// (the v0.2 file's [eval] offset).
	Limit  int `toml:"limit"`
	Offset int `toml:"-"`
	// N is how many times each row runs (1).
	N int `toml:"n"`
	// BatchSize bounds the rollouts in flight (DefaultBatchSize).
	BatchSize int `toml:"batch_size"`
	// PassThreshold: a sample passes when its reward is at least this (1.0).
	PassThreshold *float64 `toml:"pass_threshold"`
	// Budgets in seconds (450 and 150, as the Osmosis SDK's).
	AgentTimeoutS  *float64 `toml:"agent_workflow_timeout_s"`
	GraderTimeoutS *float64 `toml:"grader_timeout_s"`
}

// LLM says where the model's calls go.
type LLM struct {
	// BaseURL is an OpenAI-compatible base URL; $OPENAI_BASE_URL when empty.
	BaseURL string `toml:"base_url"`
	// APIKeyEnv names the variable holding the bearer sent upstream
	// (OPENAI_API_KEY when empty); it is looked up among the resolved
	// secrets first, then the environment.
	APIKeyEnv string `toml:"api_key_env"`
	// Engines are policy engines osmo's own rollout server spreads the
	// calls over (its --policy): base URLs ending in /v1, or
	// dns://NAME:PORT/v1. With them the server routes every call itself;
	// base_url, when set, is what the run's preflight checks.
	Engines []string `toml:"engines"`
}

// Rows is osmo's [rows] section: the training rows a run derives from
// each sample's recorded LLM calls (rows.jsonl and rows.parquet).
type Rows struct {
	// Enabled (true when unset) has the rollout's LLM calls ask the policy
	// for token ids and logprobs, and the run write its rows files. Off, it
	// asks for nothing and writes no rows file, but keeps the files an
	// earlier invocation of the run wrote current.
	Enabled *bool `toml:"enabled"`
	// Merge is "exact" (the default: a new row where a call's prompt does
	// not start with the row so far) or "realign" (keep one row, placing
	// the policy's own tokens where the template re-rendered them).
	Merge string `toml:"merge"`
	// VocabSize, when set, is the policy's vocabulary size: a token id at
	// or above it makes its call a rows problem.
	VocabSize int `toml:"vocab_size"`
}

// On reports whether rows are enabled.
func (r Rows) On() bool { return r.Enabled == nil || *r.Enabled }

// Output is the v0.2 file's [output] section.
type Output struct {
	// Path is output_path: the root runs are written under.
	Path       string `toml:"output_path"`
	LogSamples bool   `toml:"log_samples"`
	Quiet      bool   `toml:"quiet"`
	DebugLog   bool   `toml:"debug"`
}

// Defaults.
const (
	DefaultBatchSize      = 8
	DefaultAgentTimeoutS  = 450
	DefaultGraderTimeoutS = 150
	DefaultAPIKeyEnv      = "OPENAI_API_KEY"
	DefaultEntrypoint     = "main.py"
)

// ConfigError is a config that cannot run, naming the key (and the line,
// when known) at fault.
type ConfigError struct {
	Path string
	Line int // 0 when unknown
	Key  string
	Msg  string
}

func (e *ConfigError) Error() string {
	where := e.Path
	if e.Line > 0 {
		where = fmt.Sprintf("%s:%d", where, e.Line)
	}
	if e.Key != "" {
		return fmt.Sprintf("%s: %s: %s", where, e.Key, e.Msg)
	}
	return fmt.Sprintf("%s: %s", where, e.Msg)
}

// rawFile is every section of both generations. A key's presence, where
// it matters, is asked of the decoder's metadata.
type rawFile struct {
	Experiment *Experiment    `toml:"experiment"`
	Evaluation *Evaluation    `toml:"evaluation"`
	Advanced   map[string]any `toml:"advanced"`
	Env        map[string]any `toml:"env"`
	Secrets    *struct {
		Required []string `toml:"required"`
	} `toml:"secrets"`
	// [llm] is both osmo's and the v0.2 file's, which names the model.
	LLM *struct {
		LLM
		Model string `toml:"model"`
	} `toml:"llm"`
	Eval *struct {
		Rollout     string `toml:"rollout"`
		Entrypoint  string `toml:"entrypoint"`
		Dataset     string `toml:"dataset"`
		Limit       int    `toml:"limit"`
		Offset      int    `toml:"offset"`
		Fresh       bool   `toml:"fresh"`
		RetryFailed bool   `toml:"retry_failed"`
		Grader      string `toml:"grader"`
	} `toml:"eval"`
	Runs *struct {
		N             int      `toml:"n"`
		BatchSize     int      `toml:"batch_size"`
		PassThreshold *float64 `toml:"pass_threshold"`
	} `toml:"runs"`
	Timeouts *struct {
		AgentTimeoutS  *float64 `toml:"agent_workflow_timeout_s"`
		GraderTimeoutS *float64 `toml:"grader_timeout_s"`
	} `toml:"timeouts"`
	Output   *Output        `toml:"output"`
	Rows     *Rows          `toml:"rows"`     // osmo's, in either generation
	Grader   map[string]any `toml:"grader"`   // v0.2 releases before v0.2.21
	Baseline map[string]any `toml:"baseline"` // likewise
}

// The sections of each generation, for telling them apart and for errors.
var (
	currentSections = []string{"experiment", "evaluation", "env", "secrets", "advanced"}
	v02Sections     = []string{"eval", "runs", "timeouts", "output", "grader", "baseline"}
)

var (
	envNameRE    = regexp.MustCompile(`^[A-Z_][A-Z0-9_]*$`)
	secretNameRE = regexp.MustCompile(`^[A-Z][A-Z0-9_]*$`)
	commitSHARE  = regexp.MustCompile(`^[0-9a-fA-F]{7,40}$`)
)

// reservedEnvPrefix is the SDK's: the runner owns these variables.
const reservedEnvPrefix = "_OSMOSIS_"

// LoadConfig reads and checks an eval TOML of either generation. A key no
// generation knows is an error naming file, line and key: a misspelt key
// silently ignored would run something else than meant.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("eval config: %w", err)
	}
	text := string(data)
	var raw rawFile
	md, err := toml.Decode(text, &raw)
	if err != nil {
		var pe toml.ParseError
		if errors.As(err, &pe) {
			return nil, &ConfigError{Path: path, Line: pe.Position.Line, Key: pe.LastKey, Msg: pe.Message}
		}
		return nil, &ConfigError{Path: path, Msg: err.Error()}
	}
	p := &parser{path: path, text: text, md: md}
	gen, err := p.generation()
	if err != nil {
		return nil, err
	}
	for _, k := range md.Undecoded() {
		// [advanced] (and the old [grader] and [baseline]) take any keys,
		// nested tables included.
		if len(k) >= 2 && slices.Contains([]string{"advanced", "grader", "baseline"}, k[0]) {
			continue
		}
		msg, sections := "unknown key", "the sections are [experiment], [evaluation], [env], [secrets], [advanced] and osmo's [llm] and [rows]"
		if len(k) == 1 {
			msg = "unknown section"
		}
		if gen == GenerationV02 {
			sections = "this v0.2-era file's sections are [eval], [llm], [runs], [timeouts], [output] and osmo's [rows]"
		}
		return nil, &ConfigError{Path: path, Line: p.line(k), Key: k.String(), Msg: msg + " (" + sections + ")"}
	}
	c := &Config{Path: path, Generation: gen}
	if gen == GenerationV02 {
		err = p.fromV02(c, &raw)
	} else {
		err = p.fromCurrent(c, &raw)
	}
	if err != nil {
		return nil, err
	}
	if err := p.rows(c, raw.Rows); err != nil {
		return nil, err
	}
	if err := p.check(c); err != nil {
		return nil, err
	}
	return c, nil
}

// parser holds what error messages need: the file, its text and which
// keys it defines.
type parser struct {
	path, text string
	md         toml.MetaData
}

func (p *parser) errAt(key toml.Key, format string, args ...any) error {
	return &ConfigError{Path: p.path, Line: p.line(key), Key: key.String(), Msg: fmt.Sprintf(format, args...)}
}

// line is the line that sets key, or 0. The TOML decoder keeps no
// positions, so the text is searched: the key's last part inside its
// section (or the section's header, for a section).
func (p *parser) line(key toml.Key) int {
	section := ""
	for i, l := range strings.Split(p.text, "\n") {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "[") {
			section = strings.Trim(strings.TrimSpace(strings.SplitN(t, "#", 2)[0]), "[] ")
			if len(key) == 1 && section == key[0] {
				return i + 1
			}
			continue
		}
		if len(key) < 2 || section != strings.Join(key[:len(key)-1], ".") {
			continue
		}
		if k, _, ok := strings.Cut(t, "="); ok && strings.Trim(strings.TrimSpace(k), `"'`) == key[len(key)-1] {
			return i + 1
		}
	}
	return 0
}

// generation tells the file's generation by its sections; a file with
// sections of both is refused (no SDK reads it).
func (p *parser) generation() (string, error) {
	defined := func(sections []string) (out []string) {
		for _, s := range sections {
			if p.md.IsDefined(s) {
				out = append(out, "["+s+"]")
			}
		}
		return out
	}
	cur, old := defined(currentSections), defined(v02Sections)
	if p.md.IsDefined("llm", "model") && len(cur) == 0 {
		old = append(old, "[llm] model")
	}
	switch {
	case len(cur) > 0 && len(old) > 0:
		return "", &ConfigError{Path: p.path, Msg: fmt.Sprintf(
			"mixes two config generations: %s are today's, %s the v0.2-era file's; keep one",
			strings.Join(cur, ", "), strings.Join(old, ", "))}
	case len(old) > 0:
		return GenerationV02, nil
	case len(cur) == 0:
		return "", &ConfigError{Path: p.path, Msg: "Missing [experiment] section (or, in a v0.2-era file, [eval])"}
	}
	return GenerationCurrent, nil
}

func (p *parser) fromCurrent(c *Config, raw *rawFile) error {
	if raw.Experiment == nil {
		return &ConfigError{Path: p.path, Msg: "Missing [experiment] section"}
	}
	if p.md.IsDefined("llm", "model") {
		return p.errAt(toml.Key{"llm", "model"}, "is the v0.2-era file's key: today's file names the model in [experiment] model_path")
	}
	c.Experiment = *raw.Experiment
	e := &c.Experiment
	for _, k := range []string{"rollout", "model_path", "dataset"} {
		if !p.md.IsDefined("experiment", k) {
			return &ConfigError{Path: p.path, Key: "experiment." + k, Msg: "Missing '" + k + "' in [experiment] section"}
		}
	}
	branch, commit := p.md.IsDefined("experiment", "branch"), p.md.IsDefined("experiment", "commit_sha")
	if branch && (e.Branch == "" || strings.ContainsFunc(e.Branch, isSpace)) {
		return p.errAt(toml.Key{"experiment", "branch"}, "must not be empty or contain whitespace")
	}
	if commit && !commitSHARE.MatchString(e.CommitSHA) {
		return p.errAt(toml.Key{"experiment", "commit_sha"}, "must be a hexadecimal Git commit SHA (7-40 hex characters), got %q", e.CommitSHA)
	}
	if branch && commit {
		return p.errAt(toml.Key{"experiment", "commit_sha"}, "Provide either branch or commit_sha, not both")
	}
	if v := raw.Evaluation; v != nil {
		c.Evaluation = *v
		// The SDK asks for a limit above 0; osmo has always read 0 as
		// "every row", and keeps doing so.
		if v.Limit < 0 {
			return p.errAt(toml.Key{"evaluation", "limit"}, "must be 0 (all rows) or more, got %d", v.Limit)
		}
		if err := p.positive(toml.Key{"evaluation", "n"}, v.N); err != nil {
			return err
		}
		if err := p.positive(toml.Key{"evaluation", "batch_size"}, v.BatchSize); err != nil {
			return err
		}
	}
	if raw.LLM != nil {
		c.LLM = raw.LLM.LLM
	}
	c.Advanced = raw.Advanced
	if err := p.env(c, raw.Env); err != nil {
		return err
	}
	if raw.Secrets == nil {
		return nil
	}
	if !p.md.IsDefined("secrets", "required") {
		return &ConfigError{Path: p.path, Line: p.line(toml.Key{"secrets"}), Key: "secrets.required",
			Msg: `Missing 'required' in [secrets] section (a list of names, e.g. required = ["OPENAI_API_KEY"]; [] for none)`}
	}
	return p.secrets(c, raw.Secrets.Required)
}

func (p *parser) fromV02(c *Config, raw *rawFile) error {
	ev := raw.Eval
	if ev == nil {
		return &ConfigError{Path: p.path, Msg: "Missing [eval] section"}
	}
	for _, k := range []string{"rollout", "entrypoint", "dataset"} {
		if !p.md.IsDefined("eval", k) {
			return &ConfigError{Path: p.path, Key: "eval." + k, Msg: "required"}
		}
	}
	if !p.md.IsDefined("llm", "model") {
		return &ConfigError{Path: p.path, Key: "llm.model", Msg: `required: the model, LiteLLM style ("openai/gpt-4o-mini")`}
	}
	c.Experiment = Experiment{Rollout: ev.Rollout, Entrypoint: ev.Entrypoint, Dataset: ev.Dataset, ModelPath: raw.LLM.Model, Grader: ev.Grader}
	c.LLM = raw.LLM.LLM
	if err := p.positive(toml.Key{"eval", "limit"}, ev.Limit); err != nil {
		return err
	}
	if ev.Offset < 0 {
		return p.errAt(toml.Key{"eval", "offset"}, "must be 0 or more, got %d", ev.Offset)
	}
	c.Evaluation.Limit, c.Evaluation.Offset = ev.Limit, ev.Offset
	c.Fresh, c.RetryFailed = ev.Fresh, ev.RetryFailed
	if r := raw.Runs; r != nil {
		if err := p.positive(toml.Key{"runs", "n"}, r.N); err != nil {
			return err
		}
		if err := p.positive(toml.Key{"runs", "batch_size"}, r.BatchSize); err != nil {
			return err
		}
		if r.PassThreshold != nil && (*r.PassThreshold < 0 || *r.PassThreshold > 1) {
			return p.errAt(toml.Key{"runs", "pass_threshold"}, "must be between 0 and 1, got %v", *r.PassThreshold)
		}
		c.Evaluation.N, c.Evaluation.PassThreshold = r.N, r.PassThreshold
		c.Evaluation.BatchSize = cmp.Or(r.BatchSize, 1) // that generation's default
	}
	if t := raw.Timeouts; t != nil {
		c.Evaluation.AgentTimeoutS, c.Evaluation.GraderTimeoutS = t.AgentTimeoutS, t.GraderTimeoutS
	}
	if raw.Output != nil {
		c.Output = *raw.Output
	}
	if raw.Grader != nil || raw.Baseline != nil {
		c.Advanced = map[string]any{}
		if raw.Grader != nil {
			c.Advanced["grader"] = raw.Grader
		}
		if raw.Baseline != nil {
			c.Advanced["baseline"] = raw.Baseline
		}
	}
	return nil
}

// rows checks [rows]: merge is one of the two modes, "" read as exact.
func (p *parser) rows(c *Config, r *Rows) error {
	if r == nil {
		c.Rows.Merge = rows.MergeExact
		return nil
	}
	c.Rows = *r
	switch r.Merge {
	case "":
		c.Rows.Merge = rows.MergeExact
	case rows.MergeExact, rows.ModeRealign:
	default:
		return p.errAt(toml.Key{"rows", "merge"}, `must be "exact" or "realign", got %q`, r.Merge)
	}
	if r.VocabSize < 0 {
		return p.errAt(toml.Key{"rows", "vocab_size"}, "must be 0 (unknown) or more, got %d", r.VocabSize)
	}
	return nil
}

// positive checks an optional count that must be above 0 when set (the
// SDK's rule for limit, n and batch_size).
func (p *parser) positive(key toml.Key, v int) error {
	if p.md.IsDefined(key...) && v < 1 {
		return p.errAt(key, "must be a positive integer, got %d", v)
	}
	return nil
}

func isSpace(r rune) bool { return r == ' ' || r == '\t' || r == '\n' || r == '\r' }

// env checks [env] as the SDK does: string values, names of environment
// variables, none of the runner's own.
func (p *parser) env(c *Config, env map[string]any) error {
	if len(env) == 0 {
		return nil
	}
	c.Env = make(map[string]string, len(env))
	for _, k := range slices.Sorted(maps.Keys(env)) {
		key := toml.Key{"env", k}
		s, ok := env[k].(string)
		switch {
		case !ok:
			return p.errAt(key, "must be a string, got %v", env[k])
		case !envNameRE.MatchString(k):
			return p.errAt(key, "Invalid env var name '%s': must match ^[A-Z_][A-Z0-9_]*$", k)
		case strings.HasPrefix(k, reservedEnvPrefix):
			return p.errAt(key, "env var names starting with %s are reserved; choose a different name", reservedEnvPrefix)
		case strings.ContainsRune(s, 0):
			return p.errAt(key, "contains a NUL byte")
		}
		c.Env[k] = s
	}
	return nil
}

// secrets checks [secrets] required as the SDK does: unique names, none
// also in [env]. The SDK makes the section mandatory; osmo reads a file
// without it as needing no secret (its own configs never had one).
func (p *parser) secrets(c *Config, names []string) error {
	key := toml.Key{"secrets", "required"}
	seen := map[string]bool{}
	for _, n := range names {
		_, inEnv := c.Env[n]
		switch {
		case seen[n]:
			return p.errAt(key, "Duplicate secret name %s: each name must appear once", n)
		case !secretNameRE.MatchString(n):
			return p.errAt(key, "Invalid secret name '%s': use uppercase letters, digits, and underscores, starting with a letter (e.g. MY_SECRET)", n)
		case inEnv:
			return p.errAt(key, "%s appears in both [env] and [secrets]: each env var name must come from exactly one place", n)
		}
		seen[n] = true
	}
	c.Secrets = names
	return nil
}

// check fills the defaults and refuses what cannot run.
func (p *parser) check(c *Config) error {
	e, v := &c.Experiment, &c.Evaluation
	sec := c.section()
	switch {
	case strings.TrimSpace(e.Rollout) == "":
		return p.errAt(toml.Key{sec, "rollout"}, `required: a rollout of the workspace (rollouts/NAME), a workflow name, or "exec"`)
	case e.Rollout == "exec" && strings.TrimSpace(e.Entrypoint) == "":
		return p.errAt(toml.Key{sec, "entrypoint"}, `required with rollout = "exec": the agent command`)
	case strings.TrimSpace(e.Dataset) == "":
		return p.errAt(toml.Key{sec, "dataset"}, "required: a dataset file, or the name of one under the workspace's data/")
	case strings.TrimSpace(e.ModelPath) == "":
		key := toml.Key{"experiment", "model_path"}
		if c.Generation == GenerationV02 {
			key = toml.Key{"llm", "model"}
		}
		return p.errAt(key, `required: "provider/model", such as "openai/gpt-4o-mini"`)
	}
	v.N, v.BatchSize = cmp.Or(v.N, 1), cmp.Or(v.BatchSize, DefaultBatchSize)
	budgets := []struct {
		key toml.Key
		v   **float64
		def float64
	}{
		{toml.Key{"evaluation", "pass_threshold"}, &v.PassThreshold, 1},
		{toml.Key{"evaluation", "agent_workflow_timeout_s"}, &v.AgentTimeoutS, DefaultAgentTimeoutS},
		{toml.Key{"evaluation", "grader_timeout_s"}, &v.GraderTimeoutS, DefaultGraderTimeoutS},
	}
	if c.Generation == GenerationV02 {
		budgets[0].key = toml.Key{"runs", "pass_threshold"}
		budgets[1].key[0], budgets[2].key[0] = "timeouts", "timeouts"
	}
	for _, t := range budgets {
		if *t.v == nil {
			d := t.def
			*t.v = &d
		}
		if f := **t.v; math.IsNaN(f) || math.IsInf(f, 0) || (t.key[1] != "pass_threshold" && f <= 0) {
			return p.errAt(t.key, "must be a finite number (a budget above 0), got %v", f)
		}
	}
	c.LLM.APIKeyEnv = cmp.Or(c.LLM.APIKeyEnv, DefaultAPIKeyEnv)
	for _, u := range c.LLM.Engines {
		if !strings.HasPrefix(u, "http://") && !strings.HasPrefix(u, "https://") && !strings.HasPrefix(u, "dns://") {
			return p.errAt(toml.Key{"llm", "engines"}, "each engine is an http(s) base URL such as http://vllm-0:8000/v1 or dns://NAME:PORT/v1, got %q", u)
		}
	}
	return nil
}

// section is the section naming the rollout and the dataset.
func (c *Config) section() string {
	if c.Generation == GenerationV02 {
		return "eval"
	}
	return "experiment"
}

// Model is the upstream model: model_path without its "openai/" provider
// prefix (an OpenAI-compatible endpoint takes the bare model name).
func (c *Config) Model() string {
	return strings.TrimPrefix(c.Experiment.ModelPath, "openai/")
}

// Stem is the config file's name without its extension: the default
// run name starts with it.
func (c *Config) Stem() string {
	return strings.TrimSuffix(filepath.Base(c.Path), filepath.Ext(c.Path))
}
