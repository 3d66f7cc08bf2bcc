package rollout_test

import (
	"context"
	"testing"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/services/rollout"
)

// With rows on the proxy asks the policy for token ids though the agent
// did not, and the sample's calls carry them with the token strings; with
// rows off the agent's calls go upstream as they came, and each call says
// why it has no ids.
func TestRowsAskThePolicyForTokens(t *testing.T) {
	for _, rows := range []bool{true, false} {
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Rows = rows }})
		id := "rows-on"
		if !rows {
			id = "rows-off"
		}
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, id, 6, 7, "42")); err != nil {
			t.Fatal(err)
		}
		r := h.waitDone(t, id)
		if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || len(r.GetSamples()) != 1 {
			t.Fatalf("%s: rollout = %v", id, r)
		}
		for i, c := range h.g1.Chats() {
			if _, asked := c.Body["return_token_ids"]; asked != rows {
				t.Errorf("%s: call %d reached the policy with return_token_ids asked: %v, want %v", id, i, asked, rows)
			}
		}
		calls := r.GetSamples()[0].GetLlmCalls()
		if len(calls) < 2 {
			t.Fatalf("%s: %d calls recorded", id, len(calls))
		}
		for i, c := range calls {
			n := len(c.GetCompletionTokenIds())
			switch {
			case rows && (n == 0 || len(c.GetPromptTokenIds()) == 0 || len(c.GetCompletionTokenStrings()) != n || c.GetNoTokensReason() != ""):
				t.Errorf("%s: call %d: %d ids, %d prompt ids, %d token strings, reason %q", id, i, n, len(c.GetPromptTokenIds()),
					len(c.GetCompletionTokenStrings()), c.GetNoTokensReason())
			case !rows && (n != 0 || c.GetNoTokensReason() == ""):
				t.Errorf("%s: call %d: %d ids, reason %q; want none and a reason", id, i, n, c.GetNoTokensReason())
			}
		}
	}
}
