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
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/gateway"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// okConn answers every unary call with an empty response.
type okConn struct{ unusedConn }

func (okConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error { return nil }

// captureConn answers every unary call with an empty response and keeps
// the last request the gateway decoded.
type captureConn struct {
	unusedConn
	last proto.Message
}

func (c *captureConn) Invoke(_ context.Context, _ string, req, _ any, _ ...grpc.CallOption) error {
	c.last = proto.Clone(req.(proto.Message))
	return nil
}

// fuzzRoutes are the request bodies of every wire, by the fuzzer's route
// byte: G1's init, G2's and v0.3's start, and the cancel.
var fuzzRoutes = []struct {
	path string
	msg  func() proto.Message
}{
	{"/v1/rollout/init", func() proto.Message { return &rolloutv1.InitRolloutRequest{} }},
	{"/rollout", func() proto.Message { return &rolloutv1.StartRolloutRequest{} }},
	{"/rollout/cancel", func() proto.Message { return &rolloutv1.CancelRolloutsRequest{} }},
}

// FuzzRequestBodies posts any body to each wire's route: it is answered
// with the route's success or a 422 naming a reason, never anything else;
// the gateway accepts exactly what protojson accepts; and what it hands the
// service survives a round trip through the wire encoding unchanged. Seeds
// are here and in testdata/fuzz.
func FuzzRequestBodies(f *testing.F) {
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
		f.Add(uint8(0), seed)
	}
	f.Add(uint8(1), `{"rollout_id":"r","initial_messages":[{"role":"user","content":"hi"}],"label":42,"llm_api_key":null,"agent_timeout_sec":"300"}`)
	f.Add(uint8(1), `{"initial_messages":[1,2],"label":{"a":[true]},"metadata":[]}`)
	f.Add(uint8(2), `{"ids":["a"],"all":"yes"}`)
	conn := &captureConn{}
	handler, err := gateway.New(gateway.Config{Rollout: conn})
	if err != nil {
		f.Fatalf("gateway.New: %v", err)
	}
	unmarshal := protojson.UnmarshalOptions{DiscardUnknown: true}
	// A value field left unset is encoded as nothing here: with
	// EmitUnpopulated it would come back as an explicit null, which the
	// service reads the same (no label) but proto.Equal does not.
	marshal := protojson.MarshalOptions{UseProtoNames: true}

	f.Fuzz(func(t *testing.T, route uint8, body string) {
		r := fuzzRoutes[int(route)%len(fuzzRoutes)]
		conn.last = nil
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, r.path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		handler.ServeHTTP(rec, req)

		protoErr := unmarshal.Unmarshal([]byte(body), r.msg())
		empty := strings.TrimSpace(body) == ""
		switch {
		case rec.Code == http.StatusOK || rec.Code == http.StatusAccepted:
			if protoErr != nil && !empty {
				t.Fatalf("%s accepted a body protojson rejects (%v): %q", r.path, protoErr, body)
			}
			if conn.last == nil {
				t.Fatalf("%s answered %d without calling the service", r.path, rec.Code)
			}
			wire, err := marshal.Marshal(conn.last)
			if err != nil {
				t.Fatalf("the decoded request does not encode: %v", err)
			}
			again := r.msg()
			if err := unmarshal.Unmarshal(wire, again); err != nil || !proto.Equal(conn.last, again) {
				t.Fatalf("round trip changed the request (%v):\n%v\n%v", err, conn.last, again)
			}
		case rec.Code == http.StatusUnprocessableEntity:
			if protoErr == nil {
				t.Fatalf("%s rejected a body protojson accepts: %q -> %s", r.path, body, rec.Body)
			}
			var e struct {
				Detail string `json:"detail"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Detail == "" {
				t.Fatalf("422 body %q is not {\"detail\": ...}", rec.Body)
			}
		default:
			t.Fatalf("%s: status %d for %q: %s", r.path, rec.Code, body, rec.Body)
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
