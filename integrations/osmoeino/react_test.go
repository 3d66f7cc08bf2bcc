package osmoeino_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/cloudwego/eino/components/tool"
	"github.com/cloudwego/eino/components/tool/utils"
	"github.com/cloudwego/eino/compose"
	"github.com/cloudwego/eino/flow/agent/react"
	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoeino"
	"github.com/osmo-rl/osmo/internal/mockllm"
)

type factors struct {
	A float64 `json:"a"`
	B float64 `json:"b"`
}

// TestReactAgentStreaming runs Eino's ReAct agent in streaming mode, where
// the agent's branch reads only the first chunk of each reply from its own
// copy of the stream: the whole conversation must still be recorded.
func TestReactAgentStreaming(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	ctx, r := inRollout(t, upstreamRuntime(u))
	cm, err := osmoeino.NewChatModel(ctx, "react")
	if err != nil {
		t.Fatal(err)
	}
	multiply, err := utils.InferTool("multiply", "Multiply two numbers", func(_ context.Context, f factors) (float64, error) { return f.A * f.B, nil })
	if err != nil {
		t.Fatal(err)
	}
	agent, err := react.NewAgent(ctx, &react.AgentConfig{
		ToolCallingModel: cm,
		ToolsConfig:      compose.ToolsNodeConfig{Tools: []tool.BaseTool{multiply}},
	})
	if err != nil {
		t.Fatal(err)
	}
	sr, err := agent.Stream(ctx, []*schema.Message{schema.UserMessage(task)})
	if err != nil {
		t.Fatal(err)
	}
	defer sr.Close()
	var answer strings.Builder
	for {
		c, err := sr.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		answer.WriteString(c.Content)
	}
	msgs := sampleOf(t, r)
	roles := make([]string, len(msgs))
	for i, m := range msgs {
		roles[i], _ = m["role"].(string)
	}
	if strings.Join(roles, ",") != "user,assistant,tool,assistant" {
		t.Fatalf("sample roles %v, want user,assistant,tool,assistant:\n%s", roles, mustJSON(msgs))
	}
	if msgs[2]["content"] != "42" || osmo.LastAssistantText(msgs) != answer.String() || !strings.Contains(answer.String(), "42") {
		t.Errorf("sample %s, want the tool result 42 and the streamed answer %q", mustJSON(msgs), answer.String())
	}
}
