package rollout

import (
	"net/url"
	"strings"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// llmKey is the bearer of a POST /rollout rollout's LLM calls: v0.3's
// llm_api_key, or controller_api_key when it is left out.
func llmKey(req *rolloutv1.StartRolloutRequest) string {
	if req.LlmApiKey != nil {
		return req.GetLlmApiKey()
	}
	return req.GetControllerApiKey()
}

// idFromCompletionURL is the rollout id a v0.3 controller puts in its
// completion callback URL, {base}/v1/rollouts/{id}/completion, or "".
func idFromCompletionURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return ""
	}
	segs := strings.Split(strings.TrimSuffix(u.EscapedPath(), "/"), "/")
	n := len(segs)
	if n < 3 || segs[n-1] != "completion" || segs[n-3] != "rollouts" {
		return ""
	}
	id, err := url.PathUnescape(segs[n-2])
	if err != nil {
		return ""
	}
	return id
}
