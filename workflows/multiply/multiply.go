// Package multiply is the "multiply" workflow: the MultiplyWorkflow of the
// Osmosis OpenAI Agents guide as an osmo.AgentWorkflow. One agent, told to
// use its multiply tool for arithmetic, answers the row's prompt in one
// session, "multiply-agent", which is the rollout's only sample.
//
// Its reward is set by the "multiply" grader of the grader service (1.0 when
// the last assistant text contains the label), not by the workflow.
package multiply

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/big"
	"slices"
	"strconv"
	"strings"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/packages/param"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
)

// Name is the workflow's registered name.
const Name = "multiply"

// SampleID is the name of the workflow's session: the sample id of its one
// sample.
const SampleID = "multiply-agent"

// Config is the workflow's config.
type Config struct {
	osmo.AgentWorkflowConfig
	// Instructions are the agent's system message; empty sends none.
	Instructions string `json:"instructions"`
	// Temperature is the sampling temperature, 0 to 2.
	Temperature float64 `json:"temperature"`
	// MaxTokens bounds each completion; 0 leaves it to the policy server.
	MaxTokens int `json:"max_tokens"`
	// MaxTurns bounds the model calls of a rollout; 0 means
	// osmoopenai.DefaultMaxTurns.
	MaxTurns int `json:"max_turns"`
}

// DefaultConfig is the config of the Osmosis example.
func DefaultConfig() *Config {
	return &Config{
		AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: Name},
		Instructions:        "Use the multiply tool when arithmetic is required.",
		Temperature:         1.0,
		MaxTokens:           4096,
		MaxTurns:            10,
	}
}

// ConfigError reports an invalid config field.
type ConfigError struct {
	// Field is the field's JSON name.
	Field  string
	Reason string
}

func (e *ConfigError) Error() string { return "multiply: config: " + e.Field + ": " + e.Reason }

// Validate implements osmo.ConfigValidator. Every invalid field is
// reported, each as a *ConfigError.
func (c *Config) Validate() error {
	var errs []error
	if strings.TrimSpace(c.Name) == "" {
		errs = append(errs, &ConfigError{Field: "name", Reason: "must not be empty"})
	}
	if math.IsNaN(c.Temperature) || c.Temperature < 0 || c.Temperature > 2 {
		errs = append(errs, &ConfigError{Field: "temperature", Reason: fmt.Sprintf("must be between 0 and 2, got %v", c.Temperature)})
	}
	if c.MaxTokens < 0 {
		errs = append(errs, &ConfigError{Field: "max_tokens", Reason: fmt.Sprintf("must be 0 (the server's limit) or more, got %d", c.MaxTokens)})
	}
	if c.MaxTurns < 0 {
		errs = append(errs, &ConfigError{Field: "max_turns", Reason: fmt.Sprintf("must be 0 (the default, %d) or more, got %d", osmoopenai.DefaultMaxTurns, c.MaxTurns)})
	}
	return errors.Join(errs...)
}

// Workflow is the multiply agent. The zero value is ready to use and safe
// for concurrent use.
type Workflow struct {
	// tools are built once by New and shared by its rollouts (read
	// only); a zero Workflow builds them per rollout.
	tools []osmoopenai.Tool
}

var (
	_ osmo.AgentWorkflow[Config] = Workflow{}
	_ osmo.ToolProvider          = Workflow{}
	_ osmo.ConfigValidator       = (*Config)(nil)
)

// New is the workflow bound to DefaultConfig.
func New() *osmo.Workflow {
	return osmo.MustWorkflow(Workflow{tools: []osmoopenai.Tool{Tool()}}, DefaultConfig())
}

// Tools implements osmo.ToolProvider: the multiply schema, for `osmo validate`.
func (Workflow) Tools() []osmo.Tool { return []osmo.Tool{Tool().Schema()} }

// Run implements osmo.AgentWorkflow: the instructions as a system message,
// then the prompt, answered by a tool-calling loop in session SampleID.
// A prompt or config that cannot be used fails as osmo.ErrInvalidInput.
func (w Workflow) Run(ctx context.Context, wc *osmo.WorkflowContext[Config]) error {
	cfg := wc.Config
	if cfg == nil {
		cfg = DefaultConfig()
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("multiply: %w: %w", osmo.ErrInvalidInput, err)
	}
	if len(wc.Prompt) == 0 {
		return fmt.Errorf("multiply: %w: prompt is empty", osmo.ErrInvalidInput)
	}
	prompt, err := osmoopenai.MessageParams(wc.Prompt)
	if err != nil {
		return fmt.Errorf("multiply: %w: prompt: %w", osmo.ErrInvalidInput, err)
	}
	session, err := osmoopenai.NewSession(ctx, SampleID)
	if err != nil {
		return fmt.Errorf("multiply: %w", err)
	}
	if cfg.Instructions != "" {
		session.AddItems(openai.SystemMessage(cfg.Instructions))
	}
	session.AddItems(prompt...)
	tools := w.tools
	if tools == nil {
		tools = []osmoopenai.Tool{Tool()}
	}
	// The grader reads the answer from the session's messages: only the
	// text of the last reply is wanted here.
	if _, err := osmoopenai.RunText(ctx, session, openai.ChatCompletionNewParams{
		Temperature: openai.Float(cfg.Temperature),
		MaxTokens:   maxTokens(cfg.MaxTokens),
	}, tools, cfg.MaxTurns); err != nil {
		return fmt.Errorf("multiply: %w", err)
	}
	return nil
}

// maxTokens is the max_tokens param of n, omitted when n is not positive.
func maxTokens(n int) param.Opt[int64] {
	if n <= 0 {
		return param.Opt[int64]{}
	}
	return openai.Int(int64(n))
}

// Tool is the multiply tool: two integers a and b, answered with their
// product as decimal text.
func Tool() osmoopenai.Tool {
	return osmoopenai.Tool{
		Name:        "multiply",
		Description: "Multiply two integers.",
		Parameters: map[string]any{
			"type": "object",
			"properties": map[string]any{
				"a": map[string]any{"type": "integer"},
				"b": map[string]any{"type": "integer"},
			},
			"required":             []any{"a", "b"},
			"additionalProperties": false,
		},
		Call: call,
	}
}

// maxExact is the largest magnitude a float64 holds every integer up to, so
// an integral argument written as 6.0 or 6e0 is read exactly.
const maxExact = 1 << 53

// call runs one multiply call. The product is exact (math/big): no
// argument pair overflows.
func call(_ context.Context, args json.RawMessage) (string, error) {
	var in map[string]json.RawMessage
	if err := json.Unmarshal(args, &in); err != nil {
		return "", fmt.Errorf("arguments must be a JSON object with integers a and b: %w", err)
	}
	for _, k := range slices.Sorted(maps.Keys(in)) {
		if k != "a" && k != "b" {
			return "", fmt.Errorf("unknown argument %q: multiply takes integers a and b", k)
		}
	}
	a, err := integer(in, "a")
	if err != nil {
		return "", err
	}
	b, err := integer(in, "b")
	if err != nil {
		return "", err
	}
	return new(big.Int).Mul(a, b).String(), nil
}

// integer reads argument key as an integer: a JSON number without a
// fractional part.
func integer(args map[string]json.RawMessage, key string) (*big.Int, error) {
	raw, ok := args[key]
	if !ok {
		return nil, fmt.Errorf("missing argument %q: multiply takes integers a and b", key)
	}
	var n json.Number
	// A quoted number ("6") would decode into a json.Number too; the schema
	// asks for a JSON integer, so only a bare number is one.
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] == '"' || json.Unmarshal(t, &n) != nil {
		return nil, fmt.Errorf("argument %q must be an integer, got %s", key, raw)
	}
	if i, err := strconv.ParseInt(n.String(), 10, 64); err == nil {
		return big.NewInt(i), nil
	}
	f, err := strconv.ParseFloat(n.String(), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > maxExact {
		return nil, fmt.Errorf("argument %q must be an integer (at most 2^53 in magnitude), got %s", key, n)
	}
	return big.NewInt(int64(f)), nil
}
