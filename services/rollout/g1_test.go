package rollout

import (
	"encoding/json"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// The G1 completion's messages and extra fields are written as
// encoding/json writes them as maps, byte for byte.
func TestG1CompletionAsMaps(t *testing.T) {
	msg := func(kv map[string]any) *structpb.Struct {
		s, err := structpb.NewStruct(kv)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	reward := 1.0
	for _, sm := range []*rolloutv1.RolloutSample{
		{Id: "s"},
		{Id: "s", Messages: []*structpb.Struct{
			msg(map[string]any{"role": "user", "content": "<b>2 & 3</b> \u2028 \"q\" é", "n": 1.5e21}),
			msg(map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": "t", "x": []any{1e-7, true}}}}),
			{},
		}, ExtraFields: msg(map[string]any{"k": "<v>", "z": map[string]any{}}), FinishReason: "stop"},
		{Id: "s", Messages: []*structpb.Struct{msg(map[string]any{"role": "user"})}, ExtraFields: &structpb.Struct{}},
	} {
		for _, run := range []outcome.Outcome{{State: rolloutv1.State_STATE_SUCCEEDED}, outcome.Failed(outcome.Agent, "boom <x>")} {
			rec := &record{id: "r", samples: []*rolloutv1.RolloutSample{sm}, reward: &reward}
			w := &g1Wire{req: &rolloutv1.InitRolloutRequest{ServerUrl: "http://x"}}
			got, err := marshalBody(w.finished(rec, run, run)[0].body)
			if err != nil {
				t.Fatal(err)
			}
			// The body as it was built from maps: the G1 controller's
			// completion, whose fields are in the wire's order.
			var asMaps controller.Completion
			if err := json.Unmarshal(got, &asMaps); err != nil {
				t.Fatal(err)
			}
			asMaps.FinalMessages, asMaps.ExtraFields = []map[string]any{}, nil
			if run.OK() {
				asMaps.FinalMessages = fromStructs(sm.GetMessages())
				if x := sm.GetExtraFields().AsMap(); len(x) > 0 {
					asMaps.ExtraFields = x
				}
			}
			want, err := marshalBody(asMaps)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(want) {
				t.Errorf("got  %s\nwant %s", got, want)
			}
		}
	}
}
