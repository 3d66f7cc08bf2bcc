package llmproxy

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"

	lru "github.com/hashicorp/golang-lru/v2"
)

// The members Config.AskTokens adds to a request the client did not set
// them in. vLLM answers return_token_ids with prompt_token_ids at the top
// level (in a stream's first chunk) and token_ids on each choice; SGLang
// with token_ids on each choice, and return_prompt_token_ids with
// prompt_token_ids on each choice. Each engine ignores the other's name,
// so a call asks with both; but SGLang refuses its token members on a
// stream (a 400), and vLLM ignores return_prompt_token_ids, so a stream
// asks with vLLM's alone. logprobs gives logprobs.content[], whose tokens
// are the completion's token strings.
var (
	askJSON   = []string{"return_token_ids", "return_prompt_token_ids", "logprobs"}
	askStream = []string{"return_token_ids", "logprobs"}
)

// jsonTrue is the value of every member the proxy asks with.
var jsonTrue = json.RawMessage("true")

// MaxRefusingUpstreams bounds how many upstreams a Proxy remembers as
// refusing the token members; past it the least recently seen is
// forgotten, and asked once more.
const MaxRefusingUpstreams = 1024

// Reasons a recorded call has no token ids (osmo.LLMCall.NoTokensReason).
const (
	reasonNotAsked = "token ids were not asked for (rows are off)"
	// reasonRememberedPrefix starts the reason of a call that was not
	// asked because its upstream refused earlier; the refusal follows.
	reasonRememberedPrefix = "not asked: the upstream refused the token members earlier: "
)

// refusals remembers the upstreams that answered a call asking for tokens
// with a 4xx and the same call without them with a 2xx, so later calls do
// not ask them: a hosted API refuses unknown members on every call.
type refusals struct {
	seen *lru.Cache[upstreamKey, string] // → why it refused
	log  *slog.Logger
}

func newRefusals(log *slog.Logger) *refusals {
	c, err := lru.New[upstreamKey, string](MaxRefusingUpstreams)
	if err != nil {
		panic("llmproxy: " + err.Error()) // only for a size below 1
	}
	return &refusals{seen: c, log: log}
}

// upstreamKey names an upstream server and the kind of call it refused:
// an engine may take the members on a whole answer and refuse them on a
// stream, as SGLang does. The server is its scheme and host: a trainer
// gives each rollout a base URL of its own on one server (the v0.3
// wire's chat_completions_url), and the server refuses them all alike.
type upstreamKey struct {
	server string
	stream bool
}

func newUpstreamKey(baseURL string, stream bool) upstreamKey {
	server := strings.TrimSuffix(baseURL, "/")
	if u, err := url.Parse(baseURL); err == nil && u.Host != "" {
		server = u.Scheme + "://" + u.Host
	}
	return upstreamKey{server, stream}
}

// refused is why the upstream refused, or "" when it is not known to.
func (r *refusals) refused(key upstreamKey) string {
	why, _ := r.seen.Get(key)
	return why
}

// remember notes that the upstream refused, logging the first time.
func (r *refusals) remember(x *exchange, key upstreamKey, why string) {
	if known, _ := r.seen.ContainsOrAdd(key, why); known {
		return
	}
	r.log.LogAttrs(x.ctx, slog.LevelWarn, "llmproxy: the policy refuses the token members; its calls are no longer asked for token ids",
		slog.String("rollout_id", x.call.RolloutID), slog.String("sample_id", x.call.SampleID),
		slog.String("upstream", x.route.BaseURL), slog.Bool("stream", x.call.Stream), slog.String("refusal", why))
}

// refusesTokens reports whether an answer of this status to a call that
// asked for tokens may be the upstream refusing the members: what a
// request validator answers. A rate limit or an auth failure is not.
func refusesTokens(status int) bool {
	return status == http.StatusBadRequest || status == http.StatusUnprocessableEntity
}

// askTokens adds the token members the body lacks (a member set to null
// is missing) and returns their names; the client's own are kept.
func (req *chatRequest) askTokens() []string {
	names := askJSON
	if req.stream {
		names = askStream
	}
	var added []string
	for _, k := range names {
		if v, ok := req.members[k]; ok && !isNull(v) {
			continue
		}
		req.members[k] = jsonTrue
		added = append(added, k)
	}
	return added
}

// withoutTokens is the body to send again after the upstream refused the
// members askTokens added.
func (req *chatRequest) withoutTokens(added []string) []byte {
	for _, k := range added {
		delete(req.members, k)
	}
	return marshalMembers(req.members)
}

// tokensRefused is why the upstream refused: its status and the start of
// its answer.
func tokensRefused(added []string, e *upstreamError) string {
	return fmt.Sprintf("the policy answered %d to a call asking for %s: %s", e.status, strings.Join(added, ", "), e.detail)
}

// noteMissingTokens gives a call that succeeded without token ids the
// reason it has none. A failed call has its error instead.
func (x *exchange) noteMissingTokens() {
	c := x.call
	if c.Error != "" || c.StatusCode < 200 || c.StatusCode > 299 {
		return
	}
	var missing []string
	if len(c.PromptTokenIDs) == 0 {
		missing = append(missing, "prompt")
	}
	if len(c.CompletionTokenIDs) == 0 {
		missing = append(missing, "completion")
	}
	switch {
	case len(missing) == 0:
	case !x.p.askTokens:
		c.NoTokensReason = reasonNotAsked
	case x.refused != "":
		c.NoTokensReason = reasonRememberedPrefix + x.refused
	case x.refusal != "":
		c.NoTokensReason = x.refusal + "; asked again without them"
	case len(x.asked) > 0:
		c.NoTokensReason = fmt.Sprintf("the policy returned no %s token ids though asked for %s", strings.Join(missing, " or "), strings.Join(x.asked, ", "))
	default:
		c.NoTokensReason = fmt.Sprintf("the policy returned no %s token ids (the client set the token members itself)", strings.Join(missing, " or "))
	}
}
