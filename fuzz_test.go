package osmo_test

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/osmo-rl/osmo"
)

// FuzzToolCallArguments feeds a policy's tool-call arguments (text the
// model wrote) to GetToolCallInfo: they parse to an object that encodes
// back to equivalent JSON, or fail with a *ToolArgumentError naming the
// call and the tool. Seeds are in testdata/fuzz.
func FuzzToolCallArguments(f *testing.F) {
	for _, s := range []string{`{"a": 6, "b": 7}`, ``, `null`, `[1]`, `{"nested":{"x":[1,2,{"y":null}]}}`, `{"a": 1} trailing`, `{"a":"\ud800"}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, args string) {
		tc := osmo.ToolCall{ID: "call-1", Type: "function", Function: osmo.FunctionCall{Name: "multiply", Arguments: args}}
		id, name, parsed, err := osmo.GetToolCallInfo(tc)
		if id != "call-1" || name != "multiply" {
			t.Fatalf("id %q name %q", id, name)
		}
		if err != nil {
			var ae *osmo.ToolArgumentError
			if !errors.As(err, &ae) || ae.ToolCallID != "call-1" || ae.ToolName != "multiply" || parsed != nil {
				t.Fatalf("error %T %v with args %v, want a *ToolArgumentError naming the call", err, err, parsed)
			}
			return
		}
		if parsed == nil {
			t.Fatal("no error and no arguments")
		}
		if args == "" {
			return
		}
		b, err := json.Marshal(parsed)
		if err != nil {
			t.Fatalf("parsed arguments do not encode: %v", err)
		}
		var again map[string]any
		if err := json.Unmarshal(b, &again); err != nil || len(again) != len(parsed) {
			t.Fatalf("parsed arguments %v re-encode as %s", parsed, b)
		}
	})
}
