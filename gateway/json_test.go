package gateway_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/osmo-rl/osmo/gateway"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// okConn answers every unary call with an empty response.
type okConn struct{ unusedConn }

func (okConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error { return nil }

// FuzzInitRolloutBody checks that any body gets 202 or a 422 naming a
// reason, and that the gateway accepts exactly what protojson accepts.
func FuzzInitRolloutBody(f *testing.F) {
	for _, seed := range []string{
		initBody,
		`{"rollout_id": "r", "metadata": []}`,
		`{"messages": [{}, "x", null]}`,
		`{"max_turns": "1e3"}`,
		`{"max_turns": -2147483649}`,
		`{"max_tokens_total": "0x10"}`,
		`{"completion_params": {"a": 1e400}}`,
		`{"rollout_id": "a",}`,
		`[`,
		`null`,
		`"x"`,
		`{"metadata": {"a": {"b": {"c": [[[]]]}}}}`,
	} {
		f.Add(seed)
	}
	handler, err := gateway.New(gateway.Config{Rollout: okConn{}})
	if err != nil {
		f.Fatalf("gateway.New: %v", err)
	}
	unmarshal := protojson.UnmarshalOptions{DiscardUnknown: true}

	f.Fuzz(func(t *testing.T, body string) {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/v1/rollout/init", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		handler.ServeHTTP(rec, req)

		protoErr := unmarshal.Unmarshal([]byte(body), &rolloutv1.InitRolloutRequest{})
		empty := strings.TrimSpace(body) == ""
		switch rec.Code {
		case http.StatusAccepted:
			if protoErr != nil && !empty {
				t.Fatalf("accepted a body protojson rejects (%v): %q", protoErr, body)
			}
		case http.StatusUnprocessableEntity:
			if protoErr == nil {
				t.Fatalf("rejected a body protojson accepts: %q -> %s", body, rec.Body)
			}
			var e struct {
				Detail string `json:"detail"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Detail == "" {
				t.Fatalf("422 body %q is not {\"detail\": ...}", rec.Body)
			}
		default:
			t.Fatalf("status %d for %q: %s", rec.Code, body, rec.Body)
		}
	})
}

// BenchmarkInitRolloutREST measures the REST path around a call: routing,
// body decoding, the call through an in-process connection, and encoding.
func BenchmarkInitRolloutREST(b *testing.B) {
	handler, err := gateway.New(gateway.Config{Rollout: okConn{}})
	if err != nil {
		b.Fatalf("gateway.New: %v", err)
	}
	b.ReportAllocs()
	for b.Loop() {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/v1/rollout/init", strings.NewReader(initBody))
		req.Header.Set("Content-Type", "application/json")
		handler.ServeHTTP(rec, req)
		if rec.Code != http.StatusAccepted {
			b.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	}
}
