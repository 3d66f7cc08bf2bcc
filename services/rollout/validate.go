package rollout

import (
	"cmp"
	"net/url"
	"slices"
	"strings"
	"unicode/utf8"

	"golang.org/x/net/http/httpguts"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
	"github.com/osmo-rl/osmo/internal/netguard"
)

// maxIDLength bounds rollout ids and idempotency keys (Osmosis: 1..256 chars).
const maxIDLength = 256

// want is nil when ok, else the bad-input error naming field.
func want(ok bool, field, format string, args ...any) error {
	if ok {
		return nil
	}
	return fielderr.New(field, format, args...)
}

// validateInit checks a G1 init request against PROTOCOL.md.
func validateInit(req *rolloutv1.InitRolloutRequest, maxMetadataBytes int, outbound *netguard.Policy) error {
	return cmp.Or(
		validateID("rollout_id", req.GetRolloutId()),
		validateHTTPURL(outbound, "server_url", req.GetServerUrl(), true),
		want(len(req.GetMessages()) > 0, "messages", "required: at least one chat message"),
		want(req.CompletionParams != nil, "completion_params", "required: a JSON object of sampling parameters"),
		validateHTTPURL(outbound, "tool_server_url", req.GetToolServerUrl(), false),
		want(req.MaxTurns == nil || req.GetMaxTurns() > 0, "max_turns", "must be positive, got %d", req.GetMaxTurns()),
		want(req.MaxTokensTotal == nil || req.GetMaxTokensTotal() > 0, "max_tokens_total", "must be positive, got %d", req.GetMaxTokensTotal()),
		optional(req.IdempotencyKey != nil, func() error { return validateID("idempotency_key", req.GetIdempotencyKey()) }),
		validateHeaderValue("api_key", req.GetApiKey()),
		validateMetadata(req.Metadata, maxMetadataBytes),
	)
}

// optional runs check only for a field that is set.
func optional(set bool, check func() error) error {
	if !set {
		return nil
	}
	return check()
}

// validateHeaderValue checks a key that goes out as an Authorization
// header: one that cannot be would fail every delivery.
func validateHeaderValue(field, v string) error {
	if !httpguts.ValidHeaderFieldValue(v) {
		return fielderr.New(field, "must be usable as an HTTP header value: no control characters such as CR or LF")
	}
	return nil
}

func validateID(field, v string) error {
	if strings.TrimSpace(v) == "" {
		return fielderr.New(field, "must not be blank")
	}
	if n := utf8.RuneCountInString(v); n > maxIDLength {
		return fielderr.New(field, "must be at most %d characters, got %d", maxIDLength, n)
	}
	if strings.ContainsRune(v, 0) {
		return fielderr.New(field, "must not contain NUL")
	}
	return nil
}

// validateHTTPURL checks a URL a trainer names for osmo to call: http(s),
// with a host that is not an IP literal outbound denies (a host name is
// judged when dialled).
func validateHTTPURL(outbound *netguard.Policy, field, raw string, required bool) error {
	if raw == "" {
		if required {
			return fielderr.New(field, "required: an http(s) URL")
		}
		return nil
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fielderr.New(field, "must be an http(s) URL with a host, got %q", raw)
	}
	if err := outbound.CheckURL(raw); err != nil {
		return fielderr.New(field, "%v", err)
	}
	return nil
}

// maxTimeoutSec bounds the G2 and v0.3 budgets: a day.
const maxTimeoutSec = 24 * 60 * 60

// validateStart checks a POST /rollout request against PROTOCOL.md's G2,
// G3 and v0.3 rules; id is its rollout_id, or the one its completion URL
// names. chat_completions_url may be left out when the service has
// policy engines of its own (policyURLRequired false).
func validateStart(req *rolloutv1.StartRolloutRequest, id string, maxMetadataBytes int, outbound *netguard.Policy, policyURLRequired bool) error {
	labelKind := "" // what a label must not be
	switch req.GetLabel().GetKind().(type) {
	case *structpb.Value_StructValue:
		labelKind = "object"
	case *structpb.Value_ListValue:
		labelKind = "array"
	}
	return cmp.Or(
		want(id != "", "rollout_id", "required (unless completion_callback_url ends in /rollouts/{rollout_id}/completion, which then names it)"),
		validateID("rollout_id", id),
		validatePathSegment("rollout_id", id),
		validateHTTPURL(outbound, "chat_completions_url", req.GetChatCompletionsUrl(), policyURLRequired),
		validateHTTPURL(outbound, "completion_callback_url", req.GetCompletionCallbackUrl(), true),
		optional(req.GraderCallbackUrl != nil, func() error {
			return validateHTTPURL(outbound, "grader_callback_url", req.GetGraderCallbackUrl(), true)
		}),
		want(req.ControllerApiKey == nil || strings.TrimSpace(req.GetControllerApiKey()) != "",
			"controller_api_key", "must not be blank: omit it (or send null) for no key"),
		validateHeaderValue("controller_api_key", req.GetControllerApiKey()),
		want(req.LlmApiKey == nil || req.GetLlmApiKey() != "",
			"llm_api_key", "must not be empty: omit it (or send null) to use controller_api_key"),
		validateHeaderValue("llm_api_key", req.GetLlmApiKey()),
		validateTimeout("agent_timeout_sec", req.AgentTimeoutSec),
		validateTimeout("grader_timeout_sec", req.GraderTimeoutSec),
		want(labelKind == "", "label", "must be a string (or a number), got a JSON %s", labelKind),
		validateMetadata(req.Metadata, maxMetadataBytes),
	)
}

// validateTimeout checks a budget in seconds: finite and positive, if set.
func validateTimeout(field string, v *float64) error {
	if v == nil || (*v > 0 && *v <= maxTimeoutSec) {
		return nil
	}
	return fielderr.New(field, "must be a positive number of seconds up to %d, got %v", maxTimeoutSec, *v)
}

// validatePathSegment refuses ids that are not one safe URL path segment:
// they name files (--log) and appear in proxy paths.
func validatePathSegment(field, v string) error {
	if v == "." || v == ".." {
		return fielderr.New(field, "must not be %q", v)
	}
	if i := strings.IndexAny(v, "/\\"); i >= 0 {
		return fielderr.New(field, "must be one path segment: %q is not allowed", v[i:i+1])
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return fielderr.New(field, "must not contain control characters")
		}
	}
	return nil
}

// validateCancel checks that exactly one selector is given.
func validateCancel(req *rolloutv1.CancelRolloutsRequest) error {
	n := 0
	for _, set := range []bool{len(req.GetIds()) > 0, req.Prefix != nil, req.GetAll()} {
		if set {
			n++
		}
	}
	empty := slices.Index(req.GetIds(), "")
	return cmp.Or(
		want(req.Prefix == nil || req.GetPrefix() != "", "prefix", `must not be empty (use {"all": true} to cancel everything)`),
		want(n == 1, "ids", `give exactly one of "ids" (non-empty), "prefix" or "all": true`),
		want(empty < 0, "ids", "element %d is empty", empty),
	)
}

// validateMetadata bounds the encoded size of a request's metadata.
func validateMetadata(md *structpb.Struct, maxBytes int) error {
	if md == nil || maxBytes <= 0 {
		return nil
	}
	b, err := protojson.Marshal(md)
	if err != nil {
		return fielderr.New("metadata", "not encodable as JSON: %v", err)
	}
	if len(b) > maxBytes {
		return fielderr.New("metadata", "encoded size %d bytes exceeds the limit of %d bytes", len(b), maxBytes)
	}
	return nil
}
