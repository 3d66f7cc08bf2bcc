package rollout

import (
	"fmt"
	"net/url"
	"strings"
	"unicode/utf8"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// maxIDLength bounds rollout ids and idempotency keys (Osmosis: 1..256 chars).
const maxIDLength = 256

// fieldError is a bad-input error that names its field. It becomes
// InvalidArgument with a BadRequest detail, and HTTP 422 at the gateway.
type fieldError struct {
	Field  string
	Reason string
}

func (e *fieldError) Error() string { return e.Field + ": " + e.Reason }

// GRPCStatus lets status.FromError turn the error into InvalidArgument.
func (e *fieldError) GRPCStatus() *status.Status {
	st := status.New(codes.InvalidArgument, e.Error())
	if d, err := st.WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: e.Field, Description: e.Reason}},
	}); err == nil {
		return d
	}
	return st
}

func badField(field, format string, args ...any) error {
	return &fieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
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
