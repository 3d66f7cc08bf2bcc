package llmproxy

import (
	"encoding/json"
	"reflect"
	"testing"
)

func FuzzRewrite(f *testing.F) {
	f.Add([]byte(`{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"hi"}],"x":1.0}`))
	f.Add([]byte(`{ "messages" : [ {"a":"\"}]"} ] , "rollout_id":3, "model":"m", "model":"openai/osmosis-rollout"}`))
	f.Add([]byte(`{"messages":[{}],"n\u0061me":"x\\","k":[[],{},"\\\\\""]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		var req chatRequest
		if re := req.parse(body); re != nil {
			return
		}
		for _, route := range []Route{{Model: "pol"}, {InjectRolloutID: true}, {Model: "pol", InjectRolloutID: true}} {
			out, model := req.rewrite(route, "r\"1")
			if !json.Valid(out) {
				t.Fatalf("invalid output %q from %q", out, body)
			}
			var in, got map[string]any
			if err := json.Unmarshal(body, &in); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatal(err)
			}
			if got["model"] != model && !(model == req.requestedModel && req.hasModel && got["model"] == in["model"]) {
				t.Fatalf("model %v vs %v", got["model"], model)
			}
			if route.InjectRolloutID && got["rollout_id"] != "r\"1" {
				t.Fatalf("rollout id %v", got["rollout_id"])
			}
			delete(in, "model"); delete(got, "model")
			if route.InjectRolloutID {
				delete(in, "rollout_id"); delete(got, "rollout_id")
			}
			if !reflect.DeepEqual(in, got) {
				t.Fatalf("members changed: %v vs %v (body %q out %q)", in, got, body, out)
			}
		}
	})
}
