package osmoeino

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/cloudwego/eino/components/tool"

	"github.com/osmo-rl/osmo"
)

// ToolSchemas returns the OpenAI function schemas of Eino tools, as the
// chat model sends them: {"type": "function", "function": {"name",
// "description", "parameters"}}. A workflow returns them from its Tools
// method (osmo.ToolProvider) so `osmo validate` checks what the policy will
// be offered rather than a hand-kept copy.
func ToolSchemas(ctx context.Context, tools ...tool.BaseTool) ([]osmo.Tool, error) {
	out := make([]osmo.Tool, 0, len(tools))
	for i, t := range tools {
		if t == nil {
			return nil, fmt.Errorf("osmoeino.ToolSchemas: tool %d is nil", i)
		}
		info, err := t.Info(ctx)
		if err != nil {
			return nil, fmt.Errorf("osmoeino.ToolSchemas: tool %d (%T): Info: %w", i, t, err)
		}
		if info == nil || info.Name == "" {
			return nil, fmt.Errorf("osmoeino.ToolSchemas: tool %d (%T): Info returned no name", i, t)
		}
		fn := map[string]any{"name": info.Name}
		if info.Desc != "" {
			fn["description"] = info.Desc
		}
		params := map[string]any{"type": "object", "properties": map[string]any{}}
		js, err := info.ParamsOneOf.ToJSONSchema()
		if err != nil {
			return nil, fmt.Errorf("osmoeino.ToolSchemas: tool %q: parameters: %w", info.Name, err)
		}
		if js != nil {
			b, err := json.Marshal(js)
			if err != nil {
				return nil, fmt.Errorf("osmoeino.ToolSchemas: tool %q: encode parameters: %w", info.Name, err)
			}
			params = nil
			if err := json.Unmarshal(b, &params); err != nil {
				return nil, fmt.Errorf("osmoeino.ToolSchemas: tool %q: decode parameters: %w", info.Name, err)
			}
		}
		fn["parameters"] = params
		out = append(out, osmo.Tool{"type": "function", "function": fn})
	}
	return out, nil
}
