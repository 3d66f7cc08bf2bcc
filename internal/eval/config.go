// Package eval is osmo's local evaluation loop: it reads an Osmosis eval
// TOML and a dataset, drives every row through a rollout server over the
// v0.3 wire as a training cluster's controller does, journals each result
// durably, and summarises the run as the Osmosis platform does, in
// summary.json and a report a person can read.
package eval

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"

	"github.com/BurntSushi/toml"
)

// Config is an Osmosis eval TOML: [experiment], [evaluation] and osmo's
// [llm].
type Config struct {
	Experiment Experiment `toml:"experiment"`
	Evaluation Evaluation `toml:"evaluation"`
	LLM        LLM        `toml:"llm"`
	// Path is the file the config was read from; relative paths in it are
	// relative to its directory.
	Path string `toml:"-"`
}

// Experiment says what runs: the workflow, the model and the dataset.
type Experiment struct {
	// Rollout is a workflow registered in this binary, or "exec".
	Rollout string `toml:"rollout"`
	// Entrypoint is the agent command when Rollout is "exec".
	Entrypoint string `toml:"entrypoint"`
	// ModelPath is "provider/model": calls to the placeholder model go to
	// the model, named without an "openai/" prefix.
	ModelPath string `toml:"model_path"`
	// Dataset is a .jsonl, .csv or .parquet file.
	Dataset string `toml:"dataset"`
	// Grader is a grader spec; empty means the workflow's own.
	Grader string `toml:"grader"`
}

// Evaluation says how much runs and how it is judged.
type Evaluation struct {
	// Limit takes the first rows only (0: all).
	Limit int `toml:"limit"`
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
	// APIKeyEnv names the environment variable holding the bearer sent
	// upstream ("OPENAI_API_KEY" when empty).
	APIKeyEnv string `toml:"api_key_env"`
}

// Defaults of the [evaluation] section.
const (
	DefaultBatchSize      = 8
	DefaultAgentTimeoutS  = 450
	DefaultGraderTimeoutS = 150
	DefaultAPIKeyEnv      = "OPENAI_API_KEY"
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

// LoadConfig reads and checks an eval TOML. Unknown keys are errors: a
// misspelt key silently ignored would run something else than meant.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("eval config: %w", err)
	}
	c := &Config{Path: path}
	md, err := toml.Decode(string(data), c)
	if err != nil {
		var pe toml.ParseError
		if errors.As(err, &pe) {
			return nil, &ConfigError{Path: path, Line: pe.Position.Line, Key: pe.LastKey, Msg: pe.Message}
		}
		return nil, &ConfigError{Path: path, Msg: err.Error()}
	}
	if undecoded := md.Undecoded(); len(undecoded) > 0 {
		key := undecoded[0].String()
		return nil, &ConfigError{Path: path, Line: lineOf(string(data), undecoded[0][len(undecoded[0])-1]), Key: key,
			Msg: "unknown key (the sections are [experiment], [evaluation] and [llm])"}
	}
	if err := c.check(md, string(data)); err != nil {
		return nil, err
	}
	return c, nil
}

// lineOf is the first line that sets key, or 0.
func lineOf(text, key string) int {
	for i, line := range strings.Split(text, "\n") {
		if k, _, ok := strings.Cut(strings.TrimSpace(line), "="); ok && strings.Trim(strings.TrimSpace(k), `"'`) == key {
			return i + 1
		}
	}
	return 0
}

// check fills the defaults and refuses what cannot run.
func (c *Config) check(md toml.MetaData, text string) error {
	bad := func(section, key, format string, args ...any) error {
		return &ConfigError{Path: c.Path, Line: lineOf(text, key), Key: section + "." + key, Msg: fmt.Sprintf(format, args...)}
	}
	e, v := &c.Experiment, &c.Evaluation
	switch {
	case e.Rollout == "":
		return bad("experiment", "rollout", `required: a workflow name, or "exec"`)
	case e.Rollout == "exec" && strings.TrimSpace(e.Entrypoint) == "":
		return bad("experiment", "entrypoint", `required with rollout = "exec": the agent command`)
	case e.Dataset == "":
		return bad("experiment", "dataset", "required: a .jsonl, .csv or .parquet file")
	case e.ModelPath == "":
		return bad("experiment", "model_path", `required: "provider/model", such as "openai/gpt-4o-mini"`)
	case v.Limit < 0:
		return bad("evaluation", "limit", "must be 0 (all rows) or more, got %d", v.Limit)
	case v.N < 1 && md.IsDefined("evaluation", "n"):
		return bad("evaluation", "n", "must be at least 1, got %d", v.N)
	case v.BatchSize < 1 && md.IsDefined("evaluation", "batch_size"):
		return bad("evaluation", "batch_size", "must be at least 1, got %d", v.BatchSize)
	}
	if v.N == 0 {
		v.N = 1
	}
	if v.BatchSize == 0 {
		v.BatchSize = DefaultBatchSize
	}
	for _, t := range []struct {
		key string
		v   **float64
		def float64
	}{
		{"pass_threshold", &v.PassThreshold, 1},
		{"agent_workflow_timeout_s", &v.AgentTimeoutS, DefaultAgentTimeoutS},
		{"grader_timeout_s", &v.GraderTimeoutS, DefaultGraderTimeoutS},
	} {
		if *t.v == nil {
			d := t.def
			*t.v = &d
		}
		if f := **t.v; math.IsNaN(f) || math.IsInf(f, 0) || (t.key != "pass_threshold" && f <= 0) {
			return bad("evaluation", t.key, "must be a finite number (a budget above 0), got %v", f)
		}
	}
	if c.LLM.APIKeyEnv == "" {
		c.LLM.APIKeyEnv = DefaultAPIKeyEnv
	}
	return nil
}

// DatasetPath is the dataset's path, relative to the config's directory
// unless absolute.
func (c *Config) DatasetPath() string {
	if filepath.IsAbs(c.Experiment.Dataset) {
		return c.Experiment.Dataset
	}
	return filepath.Join(filepath.Dir(c.Path), c.Experiment.Dataset)
}

// Model is the upstream model: model_path without its "openai/" provider
// prefix (an OpenAI-compatible endpoint takes the bare model name).
func (c *Config) Model() string {
	return strings.TrimPrefix(c.Experiment.ModelPath, "openai/")
}

// DefaultOutput is the directory a run writes to unless told otherwise:
// named after the TOML file, beside it, so a rerun finds it.
func (c *Config) DefaultOutput() string {
	base := strings.TrimSuffix(filepath.Base(c.Path), filepath.Ext(c.Path))
	return filepath.Join(filepath.Dir(c.Path), base+".eval")
}
