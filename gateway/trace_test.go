package gateway_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/telemetry"
)

func spanAttr(s tracetest.SpanStub, key attribute.Key) string {
	for _, kv := range s.Attributes {
		if kv.Key == key {
			return kv.Value.String()
		}
	}
	return ""
}

// TestTracing: the gateway continues a trainer's trace, names spans after
// routes, and hands the rollout id of an init to the rollout service in
// the call's baggage.
func TestTracing(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newHarness(t, nil, withTracing(tp), withRootMux())

	trainer := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{0xee, 1}, SpanID: trace.SpanID{0xff, 2}, TraceFlags: trace.FlagsSampled, Remote: true})
	carrier := propagation.MapCarrier{}
	telemetry.Propagator().Inject(trace.ContextWithSpanContext(context.Background(), trainer), carrier)
	if resp := h.do(t, http.MethodPost, "/v1/rollout/init", initBody, http.Header{"Traceparent": {carrier["traceparent"]}}); resp.status != http.StatusAccepted {
		t.Fatalf("init: %d %s", resp.status, resp.body)
	}
	spans := exp.GetSpans()
	byName := map[string]tracetest.SpanStub{}
	for _, s := range spans {
		byName[s.Name] = s
	}
	server, ok := byName["POST /v1/rollout/init"]
	if !ok || server.SpanKind != trace.SpanKindServer {
		t.Fatalf("spans %v, want the server span POST /v1/rollout/init", byName)
	}
	if server.Parent.SpanID() != trainer.SpanID() || server.SpanContext.TraceID() != trainer.TraceID() {
		t.Errorf("server span parent %v, want the trainer's span", server.Parent)
	}
	client, ok := byName["osmo.rollout.v1.RolloutService/InitRollout"]
	if !ok || client.Parent.SpanID() != server.SpanContext.SpanID() || client.SpanKind != trace.SpanKindClient {
		t.Fatalf("client span %+v, want a child of the server span", client)
	}
	for _, s := range []tracetest.SpanStub{server, client} {
		if got := spanAttr(s, "osmo.rollout.id"); got != "r-1" {
			t.Errorf("%s: osmo.rollout.id = %q, want r-1", s.Name, got)
		}
	}
	md := h.md.last(t, rolloutv1.RolloutService_InitRollout_FullMethodName)
	if got := strings.Join(md.Get("baggage"), ","); !strings.Contains(got, "osmo.rollout.id=r-1") {
		t.Errorf("the rollout service got baggage %q, want the rollout id", got)
	}
	if got := strings.Join(md.Get("traceparent"), ","); !strings.Contains(got, client.SpanContext.SpanID().String()) {
		t.Errorf("the rollout service got traceparent %q, want the client span %s", got, client.SpanContext.SpanID())
	}

	// Span names never hold ids; RPCs are named by procedure.
	exp.Reset()
	h.do(t, http.MethodGet, "/v1/rollouts/r-77", "", nil)
	h.do(t, http.MethodGet, "/no/such/path", "", nil)
	conn, err := grpc.NewClient(h.h2cAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if _, err := rolloutv1.NewRolloutServiceClient(conn).Health(testContext(t), &rolloutv1.HealthRequest{}); err != nil {
		t.Fatalf("gRPC through the traced gateway: %v", err)
	}
	h.do(t, http.MethodGet, "/rollout/r-78/status", "", nil)
	names := map[string]bool{}
	for _, s := range append(spans, exp.GetSpans()...) {
		if s.SpanKind != trace.SpanKindServer {
			continue
		}
		names[s.Name] = true
		// http.route is the route of the span's name: the template after
		// the method, the procedure of an RPC, none for an unknown path.
		route, hasRoute := "", false
		for _, kv := range s.Attributes {
			if kv.Key == semconv.HTTPRouteKey {
				route, hasRoute = kv.Value.String(), true
			}
		}
		want := s.Name
		if _, tmpl, ok := strings.Cut(s.Name, " "); ok {
			want = tmpl
		} else if !strings.HasPrefix(s.Name, "/") {
			want = ""
		}
		if route != want || hasRoute != (want != "") {
			t.Errorf("span %q has http.route %q (set: %v), want %q", s.Name, route, hasRoute, want)
		}
	}
	for _, want := range []string{"POST /v1/rollout/init", "GET /v1/rollouts/{rollout_id}", "GET /rollout/{rollout_id}/status", "GET", "/osmo.rollout.v1.RolloutService/Health"} {
		if !names[want] {
			t.Errorf("server spans %v lack %q", names, want)
		}
	}
	for name := range names {
		if strings.Contains(name, "r-77") {
			t.Errorf("span name %q holds a rollout id", name)
		}
	}
}
