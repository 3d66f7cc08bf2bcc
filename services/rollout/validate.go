package rollout

import (
	"net/url"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"

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
	if req.Metadata != nil && maxMetadataBytes > 0 {
		b, err := protojson.Marshal(req.Metadata)
		if err != nil {
			return badField("metadata", "not encodable as JSON: %v", err)
		}
		if len(b) > maxMetadataBytes {
			return badField("metadata", "encoded size %d bytes exceeds the limit of %d bytes", len(b), maxMetadataBytes)
		}
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
