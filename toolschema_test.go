package osmo_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo"
)

// functionTool builds a function tool around the given function object.
func functionTool(function any) osmo.Tool {
	return osmo.Tool{"type": "function", "function": function}
}

// toolWithParams builds a tool named "t" with the given parameters schema.
func toolWithParams(p any) osmo.Tool {
	return functionTool(map[string]any{"name": "t", "parameters": p})
}

// toolFromJSON decodes a tool the way it arrives from a config file or a
// G1 get_tools answer: []any, float64 and nested map[string]any.
func toolFromJSON(t *testing.T, s string) osmo.Tool {
	t.Helper()
	var tl osmo.Tool
	if err := json.Unmarshal([]byte(s), &tl); err != nil {
		t.Fatalf("decode %s: %v", s, err)
	}
	return tl
}

func TestValidateTool(t *testing.T) {
	tests := []struct {
		name     string
		tool     func(t *testing.T) osmo.Tool
		wantName string
		wantErr  []string // substrings; nil: valid
	}{
		{
			name:     "minimal",
			tool:     func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": "ping"}) },
			wantName: "ping",
		},
		{
			name: "full, decoded from JSON",
			tool: func(t *testing.T) osmo.Tool {
				return toolFromJSON(t, `{"type":"function","function":{"name":"multiply","description":"Multiply two integers.",
					"parameters":{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}},
					"required":["a","b"],"additionalProperties":false}}}`)
			},
			wantName: "multiply",
		},
		{
			name: "[]string required",
			tool: func(*testing.T) osmo.Tool {
				return toolWithParams(map[string]any{"type": "object",
					"properties": map[string]any{"q": map[string]any{"type": "string"}},
					"required":   []string{"q"}})
			},
			wantName: "t",
		},
		{
			name: "parameters null",
			tool: func(t *testing.T) osmo.Tool {
				return toolFromJSON(t, `{"type":"function","function":{"name":"t","parameters":null}}`)
			},
			wantName: "t",
		},
		{
			name:     "parameters without properties",
			tool:     func(*testing.T) osmo.Tool { return toolWithParams(map[string]any{"type": "object"}) },
			wantName: "t",
		},
		{
			name:     "name of 64 characters",
			tool:     func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": strings.Repeat("n", 64)}) },
			wantName: strings.Repeat("n", 64),
		},
		{
			name:     "name with digits, _ and -",
			tool:     func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": "get_weather-2"}) },
			wantName: "get_weather-2",
		},
		{
			name:    "nil tool",
			tool:    func(*testing.T) osmo.Tool { return nil },
			wantErr: []string{"tool is null"},
		},
		{
			name: "wrong type",
			tool: func(*testing.T) osmo.Tool {
				return osmo.Tool{"type": "retrieval", "function": map[string]any{"name": "t"}}
			},
			wantErr: []string{`"type" must be "function"`, "retrieval"},
		},
		{
			name:    "type missing",
			tool:    func(*testing.T) osmo.Tool { return osmo.Tool{"function": map[string]any{"name": "t"}} },
			wantErr: []string{`"type" must be "function"`},
		},
		{
			name:    "function missing",
			tool:    func(*testing.T) osmo.Tool { return osmo.Tool{"type": "function"} },
			wantErr: []string{`"function" must be an object`},
		},
		{
			name:    "function not an object",
			tool:    func(*testing.T) osmo.Tool { return functionTool("multiply") },
			wantErr: []string{`"function" must be an object`},
		},
		{
			name:    "name missing",
			tool:    func(*testing.T) osmo.Tool { return functionTool(map[string]any{"description": "x"}) },
			wantErr: []string{`tool name ""`},
		},
		{
			name:    "name with spaces",
			tool:    func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": "get weather"}) },
			wantErr: []string{`"get weather"`, "1-64 letters, digits, _ or -"},
		},
		{
			name:    "name of 65 characters",
			tool:    func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": strings.Repeat("n", 65)}) },
			wantErr: []string{strings.Repeat("n", 65), "1-64"},
		},
		{
			name:    "name not a string",
			tool:    func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": 7}) },
			wantErr: []string{"tool name"},
		},
		{
			name:    "description not a string",
			tool:    func(*testing.T) osmo.Tool { return functionTool(map[string]any{"name": "t", "description": 42}) },
			wantErr: []string{`tool "t"`, "description must be a string"},
		},
		{
			name:    "parameters not an object",
			tool:    func(*testing.T) osmo.Tool { return toolWithParams([]any{"a"}) },
			wantErr: []string{`tool "t"`, "parameters must be a JSON Schema object"},
		},
		{
			name:    "parameters.type not object",
			tool:    func(*testing.T) osmo.Tool { return toolWithParams(map[string]any{"type": "array"}) },
			wantErr: []string{`parameters.type must be "object"`, "array"},
		},
		{
			name:    "parameters.type missing",
			tool:    func(*testing.T) osmo.Tool { return toolWithParams(map[string]any{"properties": map[string]any{}}) },
			wantErr: []string{`parameters.type must be "object"`},
		},
		{
			name: "properties not an object",
			tool: func(*testing.T) osmo.Tool {
				return toolWithParams(map[string]any{"type": "object", "properties": []any{"a"}})
			},
			wantErr: []string{"parameters.properties must be an object"},
		},
		{
			name: "property not a schema",
			tool: func(*testing.T) osmo.Tool {
				return toolWithParams(map[string]any{"type": "object", "properties": map[string]any{"a": "integer"}})
			},
			wantErr: []string{"parameters.properties.a must be a schema object"},
		},
		{
			name: "required not an array",
			tool: func(*testing.T) osmo.Tool {
				return toolWithParams(map[string]any{"type": "object", "properties": map[string]any{"a": map[string]any{}}, "required": "a"})
			},
			wantErr: []string{"parameters.required must be an array"},
		},
		{
			name: "required holds a non-string",
			tool: func(t *testing.T) osmo.Tool {
				return toolFromJSON(t, `{"type":"function","function":{"name":"t","parameters":{"type":"object","properties":{"a":{}},"required":[1]}}}`)
			},
			wantErr: []string{"parameters.required holds 1"},
		},
		{
			name: "required names an unknown property",
			tool: func(*testing.T) osmo.Tool {
				return toolWithParams(map[string]any{"type": "object",
					"properties": map[string]any{"a": map[string]any{"type": "integer"}},
					"required":   []any{"a", "b"}})
			},
			wantErr: []string{`required parameter "b" is not among the properties`},
		},
		{
			name: "[]string required naming an unknown property",
			tool: func(*testing.T) osmo.Tool {
				return toolWithParams(map[string]any{"type": "object", "required": []string{"missing"}})
			},
			wantErr: []string{`required parameter "missing"`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name, err := osmo.ValidateTool(tt.tool(t))
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("ValidateTool: %v", err)
				}
				if name != tt.wantName {
					t.Errorf("name = %q, want %q", name, tt.wantName)
				}
				return
			}
			if err == nil {
				t.Fatalf("ValidateTool = %q, nil; want an error", name)
			}
			for _, s := range tt.wantErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %q", err, s)
				}
			}
		})
	}
}
