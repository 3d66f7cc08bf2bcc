package osmoeino_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cloudwego/eino/components/tool"
	"github.com/cloudwego/eino/components/tool/utils"
	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoeino"
)

type addArgs struct {
	A float64 `json:"a" jsonschema:"description=first term"`
	B float64 `json:"b" jsonschema:"description=second term"`
}

// infoTool is a tool whose Info is given.
type infoTool struct {
	info *schema.ToolInfo
	err  error
}

func (t infoTool) Info(context.Context) (*schema.ToolInfo, error) { return t.info, t.err }

func TestToolSchemas(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	add, err := utils.InferTool("add", "Add two numbers", func(_ context.Context, a addArgs) (float64, error) { return a.A + a.B, nil })
	if err != nil {
		t.Fatal(err)
	}
	got, err := osmoeino.ToolSchemas(ctx, add, infoTool{info: multiplyInfo()}, infoTool{info: &schema.ToolInfo{Name: "now"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("got %d schemas, want 3", len(got))
	}
	for i, s := range got {
		if _, err := osmo.ValidateTool(s); err != nil {
			t.Errorf("schema %d %s: osmo.ValidateTool: %v", i, mustJSON(s), err)
		}
	}
	want := jsonMessages(t, `[
		{"type":"function","function":{"name":"add","description":"Add two numbers","parameters":{"type":"object",
			"properties":{"a":{"type":"number","description":"first term"},"b":{"type":"number","description":"second term"}},
			"required":["a","b"],"additionalProperties":false}}},
		{"type":"function","function":{"name":"multiply","description":"Multiply two numbers","parameters":{"type":"object",
			"properties":{"a":{"type":"number"},"b":{"type":"number"}},"required":["a","b"]}}},
		{"type":"function","function":{"name":"now","parameters":{"type":"object","properties":{}}}}
	]`)
	for i := range want {
		if !reflect.DeepEqual(got[i], osmo.Tool(want[i])) {
			t.Errorf("schema %d:\n got %s\nwant %s", i, mustJSON(got[i]), mustJSON(want[i]))
		}
	}
}

func TestToolSchemasRefuses(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name string
		tool tool.BaseTool
		want string
	}{
		{name: "nil", tool: nil, want: "tool 0 is nil"},
		{name: "info fails", tool: infoTool{err: errors.New("boom")}, want: "boom"},
		{name: "no name", tool: infoTool{info: &schema.ToolInfo{}}, want: "no name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := osmoeino.ToolSchemas(ctx, tc.tool)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ToolSchemas = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
