package rollout

import (
	"net/url"
	"strings"
	"unicode/utf8"

	"golang.org/x/net/http/httpguts"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
)

// maxIDLength bounds rollout ids and idempotency keys (Osmosis: 1..256 chars).
const maxIDLength = 256

// badField is a bad-input error naming its field.
func badField(field, format string, args ...any) error {
	return fielderr.New(field, format, args...)
}

// validateInit checks a G1 init request against PROTOCOL.md.
func validateInit(req *rolloutv1.InitRolloutRequest, maxMetadataBytes int) error {
	if err := validateID("rollout_id", req.GetRolloutId()); err != nil {
		return err
	}
	if err := validateHTTPURL("server_url", req.GetServerUrl(), true); err != nil {
		return err
	}
	if len(req.GetMessages()) == 0 {
		return badField("messages", "required: at least one chat message")
	}
	if req.CompletionParams == nil {
		return badField("completion_params", "required: a JSON object of sampling parameters")
	}
	if req.ToolServerUrl != nil {
		if err := validateHTTPURL("tool_server_url", req.GetToolServerUrl(), false); err != nil {
			return err
		}
	}
	if req.MaxTurns != nil && req.GetMaxTurns() <= 0 {
		return badField("max_turns", "must be positive, got %d", req.GetMaxTurns())
	}
	if req.MaxTokensTotal != nil && req.GetMaxTokensTotal() <= 0 {
		return badField("max_tokens_total", "must be positive, got %d", req.GetMaxTokensTotal())
	}
	if req.IdempotencyKey != nil {
		if err := validateID("idempotency_key", req.GetIdempotencyKey()); err != nil {
			return err
		}
	}
	if err := validateHeaderValue("api_key", req.GetApiKey()); err != nil {
		return err
	}
	return validateMetadata(req.Metadata, maxMetadataBytes)
}

// validateHeaderValue checks a key that goes out as an Authorization
// header, on the callbacks and to the policy: one that cannot be a header
// value would fail every delivery, after the rollout ran.
func validateHeaderValue(field, v string) error {
	if !httpguts.ValidHeaderFieldValue(v) {
		return badField(field, "must be usable as an HTTP header value: no control characters such as CR or LF")
	}
	return nil
}

func validateID(field, v string) error {
	if strings.TrimSpace(v) == "" {
		return badField(field, "must not be blank")
	}
	if n := utf8.RuneCountInString(v); n > maxIDLength {
		return badField(field, "must be at most %d characters, got %d", maxIDLength, n)
	}
	if strings.ContainsRune(v, 0) {
		return badField(field, "must not contain NUL")
	}
	return nil
}

func validateHTTPURL(field, raw string, required bool) error {
	if raw == "" {
		if required {
			return badField(field, "required: an http(s) URL")
		}
		return nil
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return badField(field, "must be an http(s) URL with a host, got %q", raw)
	}
	return nil
}

// maxTimeoutSec bounds the G2 budgets: a day is longer than any rollout.
const maxTimeoutSec = 24 * 60 * 60

// validateStart checks a G2 start request against PROTOCOL.md (with the G3
// rule that a rollout id is one safe path segment).
func validateStart(req *rolloutv1.StartRolloutRequest, maxMetadataBytes int) error {
	if err := validateID("rollout_id", req.GetRolloutId()); err != nil {
		return err
	}
	if err := validatePathSegment("rollout_id", req.GetRolloutId()); err != nil {
		return err
	}
	if err := validateHTTPURL("chat_completions_url", req.GetChatCompletionsUrl(), true); err != nil {
		return err
	}
	if err := validateHTTPURL("completion_callback_url", req.GetCompletionCallbackUrl(), true); err != nil {
		return err
	}
	if req.GraderCallbackUrl != nil {
		if err := validateHTTPURL("grader_callback_url", req.GetGraderCallbackUrl(), true); err != nil {
			return err
		}
	}
	if req.ControllerApiKey != nil && strings.TrimSpace(req.GetControllerApiKey()) == "" {
		return badField("controller_api_key", "must not be blank: omit it (or send null) for no key")
	}
	if err := validateHeaderValue("controller_api_key", req.GetControllerApiKey()); err != nil {
		return err
	}
	for _, t := range []struct {
		field string
		v     *float64
	}{{"agent_timeout_sec", req.AgentTimeoutSec}, {"grader_timeout_sec", req.GraderTimeoutSec}} {
		if t.v == nil {
			continue
		}
		if v := *t.v; !(v > 0) || v > maxTimeoutSec {
			return badField(t.field, "must be a positive number of seconds up to %d, got %v", maxTimeoutSec, v)
		}
	}
	switch req.GetLabel().GetKind().(type) {
	case *structpb.Value_StructValue, *structpb.Value_ListValue:
		return badField("label", "must be a string (or a number), got a JSON %s", kindName(req.GetLabel()))
	}
	return validateMetadata(req.Metadata, maxMetadataBytes)
}

func kindName(v *structpb.Value) string {
	if _, ok := v.GetKind().(*structpb.Value_ListValue); ok {
		return "array"
	}
	return "object"
}

// validatePathSegment refuses ids that are not one safe URL path segment:
// they name files (--log) and appear in proxy paths.
func validatePathSegment(field, v string) error {
	if v == "." || v == ".." {
		return badField(field, "must not be %q", v)
	}
	if i := strings.IndexAny(v, "/\\"); i >= 0 {
		return badField(field, "must be one path segment: %q is not allowed", v[i:i+1])
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return badField(field, "must not contain control characters")
		}
	}
	return nil
}

// validateCancel checks that exactly one selector is given.
func validateCancel(req *rolloutv1.CancelRolloutsRequest) error {
	n := 0
	if len(req.GetIds()) > 0 {
		n++
	}
	if req.Prefix != nil {
		n++
		if req.GetPrefix() == "" {
			return badField("prefix", `must not be empty (use {"all": true} to cancel everything)`)
		}
	}
	if req.GetAll() {
		n++
	}
	if n != 1 {
		return badField("ids", `give exactly one of "ids" (non-empty), "prefix" or "all": true`)
	}
	for i, id := range req.GetIds() {
		if id == "" {
			return badField("ids", "element %d is empty", i)
		}
	}
	return nil
}

// validateMetadata bounds the encoded size of a request's metadata.
func validateMetadata(md *structpb.Struct, maxBytes int) error {
	if md == nil || maxBytes <= 0 {
		return nil
	}
	b, err := protojson.Marshal(md)
	if err != nil {
		return badField("metadata", "not encodable as JSON: %v", err)
	}
	if len(b) > maxBytes {
		return badField("metadata", "encoded size %d bytes exceeds the limit of %d bytes", len(b), maxBytes)
	}
	return nil
}
