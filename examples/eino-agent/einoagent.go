// Package einoagent is an AgentWorkflow built with CloudWeGo Eino: a ReAct
// agent with a multiply tool, its chat model bound to the rollout by
// integrations/osmoeino. Serve it like any workflow (New returns it); its
// sample is the agent's conversation, recorded by the chat model.
package einoagent

import (
	"context"
	"fmt"

	"github.com/cloudwego/eino/components/tool"
	"github.com/cloudwego/eino/components/tool/utils"
	"github.com/cloudwego/eino/compose"
	"github.com/cloudwego/eino/flow/agent/react"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoeino"
)

// Name is the workflow's name.
const Name = "eino-calculator"

// AgentName is the sample id of the agent's conversation.
const AgentName = "calculator-agent"

// Config is the workflow's config.
type Config struct {
	osmo.AgentWorkflowConfig
	// Temperature is the policy's sampling temperature, in [0, 2].
	Temperature float32 `json:"temperature"`
	// MaxSteps bounds the agent's graph steps: each model turn and each
	// round of tool calls is one step. 0 is Eino's default (the graph's
	// node count plus 10).
	MaxSteps int `json:"max_steps"`
}

// Validate implements osmo.ConfigValidator.
func (c *Config) Validate() error {
	if !(c.Temperature >= 0 && c.Temperature <= 2) {
		return fmt.Errorf("temperature must be within [0, 2], got %v", c.Temperature)
	}
	if c.MaxSteps < 0 {
		return fmt.Errorf("max_steps must be 0 (Eino's default) or more, got %d", c.MaxSteps)
	}
	return nil
}

// DefaultConfig is the config New binds.
func DefaultConfig() *Config {
	return &Config{
		AgentWorkflowConfig: osmo.AgentWorkflowConfig{
			Name:        Name,
			Description: "Arithmetic with an Eino ReAct agent and a multiply tool.",
		},
		Temperature: 1,
		MaxSteps:    12,
	}
}

// Workflow is the eino-calculator AgentWorkflow. The zero value is ready to
// use and safe for concurrent rollouts: every rollout builds its own model
// and agent.
type Workflow struct{}

var (
	_ osmo.AgentWorkflow[Config] = Workflow{}
	_ osmo.ToolProvider          = Workflow{}
)

// New returns the workflow bound to DefaultConfig.
func New() *osmo.Workflow { return osmo.MustWorkflow[Config](Workflow{}, DefaultConfig()) }

// MultiplyArgs are the multiply tool's arguments.
type MultiplyArgs struct {
	A float64 `json:"a" jsonschema:"description=The first factor"`
	B float64 `json:"b" jsonschema:"description=The second factor"`
}

// MultiplyTool returns the multiply tool. A call the tool cannot run (bad
// arguments) answers "Error: ..." to the model instead of ending the
// rollout, so the policy gets a chance to correct itself.
func MultiplyTool() (tool.BaseTool, error) {
	t, err := utils.InferTool("multiply", "Multiply two numbers and return the product.",
		func(_ context.Context, args MultiplyArgs) (float64, error) { return args.A * args.B, nil })
	if err != nil {
		return nil, fmt.Errorf("einoagent: multiply tool: %w", err)
	}
	return utils.WrapToolWithErrorHandler(t, func(_ context.Context, err error) string {
		return "Error: " + err.Error()
	}), nil
}

// Tools implements osmo.ToolProvider with the schemas the model is offered.
// It panics only if the tool definitions themselves are broken, which
// osmo.MustWorkflow surfaces when the package's workflow is built.
func (Workflow) Tools() []osmo.Tool {
	t, err := MultiplyTool()
	if err != nil {
		panic(err)
	}
	schemas, err := osmoeino.ToolSchemas(context.Background(), t)
	if err != nil {
		panic(err)
	}
	return schemas
}

// Run implements osmo.AgentWorkflow: the agent answers the prompt, calling
// multiply as it sees fit, until it gives a plain answer.
func (Workflow) Run(ctx context.Context, wc *osmo.WorkflowContext[Config]) error {
	cfg := wc.Config
	if cfg == nil {
		cfg = DefaultConfig()
	}
	prompt, err := osmoeino.SchemaMessages(wc.Prompt)
	if err != nil {
		return fmt.Errorf("einoagent: prompt: %w", err)
	}
	if len(prompt) == 0 {
		return fmt.Errorf("einoagent: prompt: %w: no messages", osmo.ErrInvalidInput)
	}
	cm, err := osmoeino.NewChatModel(ctx, AgentName, osmoeino.WithTemperature(cfg.Temperature))
	if err != nil {
		return fmt.Errorf("einoagent: %w", err)
	}
	multiply, err := MultiplyTool()
	if err != nil {
		return err
	}
	agent, err := react.NewAgent(ctx, &react.AgentConfig{
		ToolCallingModel: cm,
		ToolsConfig:      compose.ToolsNodeConfig{Tools: []tool.BaseTool{multiply}},
		MaxStep:          cfg.MaxSteps,
	})
	if err != nil {
		return fmt.Errorf("einoagent: build agent: %w", err)
	}
	// The answer needs no handling here: the chat model recorded the
	// conversation ending in it, which is what gets graded.
	if _, err := agent.Generate(ctx, prompt); err != nil {
		return fmt.Errorf("einoagent: run agent: %w", err)
	}
	return nil
}
