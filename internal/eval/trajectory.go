package eval

import (
	"encoding/json"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
)

// atifVersion is the ATIF schema the SDK writes trajectories in.
const atifVersion = "ATIF-v1.7"

// trajectory is r's ATIF trajectory, as the SDK's rollout server makes one
// of a sample's messages (convert_sample_to_trajectory): a step per
// message (an unknown role as user, keeping it under extra.original_role),
// a tool message folded into the agent step before it as an observation,
// and the rollout's id, label, reward and row metadata under
// extra.osmosis. nil when r has no messages.
func (f *sdkFiles) trajectory(r Result) *atifDocument {
	var steps []map[string]any
	for _, m := range r.Messages {
		role, _ := m["role"].(string)
		if role == "tool" || role == "function" {
			steps = attachToolResult(steps, m)
			continue
		}
		source, known := map[string]string{"system": "system", "developer": "system", "assistant": "agent", "user": "user"}[role]
		extra := map[string]any{}
		if !known {
			source = "user"
			extra["original_role"] = role
		}
		step := map[string]any{"step_id": len(steps) + 1, "source": source, "message": TextOf(m["content"])}
		// Only an agent step may carry tool calls and reasoning; any other
		// keeps them in its extra.
		carrier := extra
		if source == "agent" {
			carrier = step
			if model, ok := m["model"].(string); ok && model != "" {
				step["model_name"] = model
			}
		}
		if calls := toolCalls(m["tool_calls"]); calls != nil {
			carrier["tool_calls"] = calls
		}
		if reasoning := m["reasoning_content"]; reasoning != nil {
			if _, ok := reasoning.(string); !ok {
				b, _ := json.Marshal(reasoning)
				reasoning = string(b)
			}
			carrier["reasoning_content"] = reasoning
		}
		if len(extra) > 0 {
			step["extra"] = extra
		}
		steps = append(steps, step)
	}
	if len(steps) == 0 {
		return nil
	}
	osmosis := map[string]any{"rollout_id": r.RolloutID}
	row, ok := f.rows[r.RowIndex]
	if ok && row.Label != nil {
		osmosis["label"] = *row.Label
	}
	if r.Reward != nil {
		osmosis["reward"] = *r.Reward
	}
	if ok && len(row.Metadata) > 0 {
		osmosis["request_metadata"] = row.Metadata
	}
	agent := map[string]any{"name": "osmo", "version": osmoVersion()}
	if f.p.Model != "" {
		agent["model_name"] = f.p.Model
	}
	return &atifDocument{
		SchemaVersion: atifVersion, SessionID: r.RolloutID, TrajectoryID: r.RolloutID, Agent: agent, Steps: steps,
		FinalMetrics: map[string]any{"total_steps": len(steps)}, Extra: map[string]any{"osmosis": osmosis},
	}
}

// atifDocument is an ATIF trajectory, its keys in the SDK's order.
type atifDocument struct {
	SchemaVersion string           `json:"schema_version"`
	SessionID     string           `json:"session_id"`
	TrajectoryID  string           `json:"trajectory_id"`
	Agent         map[string]any   `json:"agent"`
	Steps         []map[string]any `json:"steps"`
	FinalMetrics  map[string]any   `json:"final_metrics"`
	Extra         map[string]any   `json:"extra"`
}

// attachToolResult folds a tool message into the agent step before it.
func attachToolResult(steps []map[string]any, m map[string]any) []map[string]any {
	callID, _ := m["tool_call_id"].(string)
	result := map[string]any{"content": TextOf(m["content"])}
	var target map[string]any
	if n := len(steps); n > 0 && steps[n-1]["source"] == "agent" {
		target = steps[n-1]
	}
	calls, _ := target["tool_calls"].([]map[string]any)
	if callID != "" && slices.ContainsFunc(calls, func(c map[string]any) bool { return c["tool_call_id"] == callID }) {
		result["source_call_id"] = callID
	} else {
		result["extra"] = map[string]any{"tool_call_id": m["tool_call_id"]}
	}
	if target == nil {
		role, _ := m["role"].(string)
		return append(steps, map[string]any{
			"step_id": len(steps) + 1, "source": "system", "message": "",
			"observation": map[string]any{"results": []map[string]any{result}},
			"extra":       map[string]any{"original_role": role},
		})
	}
	obs, _ := target["observation"].(map[string]any)
	if obs == nil {
		target["observation"] = map[string]any{"results": []map[string]any{result}}
	} else {
		obs["results"] = append(obs["results"].([]map[string]any), result)
	}
	return steps
}

// toolCalls are an OpenAI message's tool calls in ATIF's shape.
func toolCalls(raw any) []map[string]any {
	list, _ := raw.([]any)
	var out []map[string]any
	for i, item := range list {
		call, ok := item.(map[string]any)
		if !ok {
			continue
		}
		fn, _ := call["function"].(map[string]any)
		id, _ := call["id"].(string)
		name, _ := fn["name"].(string)
		if id == "" {
			id = "call_" + strconv.Itoa(i)
		}
		if name == "" {
			name = "unknown"
		}
		out = append(out, map[string]any{"tool_call_id": id, "function_name": name, "arguments": arguments(fn["arguments"])})
	}
	return out
}

func arguments(raw any) map[string]any {
	switch a := raw.(type) {
	case map[string]any:
		return a
	case string:
		if a == "" {
			return map[string]any{}
		}
		var parsed map[string]any
		if json.Unmarshal([]byte(a), &parsed) == nil && parsed != nil {
			return parsed
		}
		return map[string]any{"_raw": a}
	}
	return map[string]any{}
}

// TextOf flattens a message's content to text, as the SDK does: text
// parts joined by newlines, anything else as JSON.
func TextOf(content any) string {
	switch c := content.(type) {
	case nil:
		return ""
	case string:
		return c
	case []any:
		texts := make([]string, 0, len(c))
		for _, p := range c {
			part, ok := p.(map[string]any)
			if !ok || part["type"] != "text" {
				texts = nil
				break
			}
			t, _ := part["text"].(string)
			texts = append(texts, t)
		}
		if len(texts) > 0 {
			return strings.Join(texts, "\n")
		}
	}
	b, _ := json.Marshal(content)
	return string(b)
}

// validTrajectory reports whether data is an ATIF document of rollout id,
// by the identity the platform reads: extra.osmosis.rollout_id, else
// session_id, else trajectory_id up to its first "/".
func validTrajectory(data []byte, id string) bool {
	var doc struct {
		SessionID    string `json:"session_id"`
		TrajectoryID string `json:"trajectory_id"`
		Extra        struct {
			Osmosis struct {
				RolloutID string `json:"rollout_id"`
			} `json:"osmosis"`
		} `json:"extra"`
	}
	if json.Unmarshal(data, &doc) != nil {
		return false
	}
	got := doc.Extra.Osmosis.RolloutID
	if got == "" {
		got = doc.SessionID
	}
	if before, _, found := strings.Cut(doc.TrajectoryID, "/"); got == "" && found {
		got = before
	}
	return got != "" && got == id
}

// osmoVersion is this binary's module version ("dev" from a work tree).
func osmoVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
