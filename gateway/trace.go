package gateway

import (
	"context"
	"net/http"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/baggage"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// traced wraps h in an HTTP server span per request. The caller's trace
// context is honoured: a trainer that sends a traceparent gets the whole
// rollout inside its own trace.
func traced(h http.Handler, tp trace.TracerProvider, prop propagation.TextMapPropagator) http.Handler {
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	return otelhttp.NewHandler(h, "osmo-gateway",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(prop),
		// Prometheus has the metrics; no global meter provider.
		otelhttp.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelhttp.WithSpanNameFormatter(spanName))
}

// spanName names a request's span after its route, never after ids in its
// path: "POST /v1/rollout/init", "GET /v1/rollouts/{rollout_id}",
// "POST /rollout", "GET /rollout/{rollout_id}/status", the
// procedure of an RPC ("/osmo.rollout.v1.RolloutService/InitRollout"), or
// just the method for paths the gateway does not serve.
func spanName(_ string, r *http.Request) string {
	p := r.URL.Path
	switch {
	case strings.HasPrefix(p, "/osmo.") || strings.HasPrefix(p, "/grpc."):
		if strings.Count(p, "/") == 2 {
			return p
		}
	case p == "/v1/rollout/init" || p == "/v1/rollouts:watch" || p == "/v1/grade" ||
		p == "/rollout" || p == "/rollout/cancel" ||
		p == "/health" || p == "/platform/health" || p == "/openapi.json":
		return r.Method + " " + p
	case strings.HasPrefix(p, "/v1/rollouts/") && !strings.Contains(p[len("/v1/rollouts/"):], "/"):
		return r.Method + " /v1/rollouts/{rollout_id}"
	case strings.HasPrefix(p, "/rollout/") && strings.HasSuffix(p, "/status") && strings.Count(p, "/") == 3:
		return r.Method + " /rollout/{rollout_id}/status"
	}
	return r.Method
}

// rolloutIDConn learns the rollout id from the requests that start a
// rollout (G1 InitRollout, G2 StartRollout), where the gateway first sees it: it tags the request's span (the HTTP server span,
// started before the body was read) and puts the id into the baggage, so
// the call's client span and every span the rollout service starts for it
// carry osmo.rollout.id (telemetry.BaggageAttributes).
type rolloutIDConn struct {
	grpc.ClientConnInterface
}

func (c rolloutIDConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	var id string
	switch req := args.(type) {
	case *rolloutv1.InitRolloutRequest:
		id = req.GetRolloutId()
	case *rolloutv1.StartRolloutRequest:
		id = req.GetRolloutId()
	}
	if id != "" {
		if baggage.FromContext(ctx).Member(string(osmoattr.RolloutID)).Value() != id {
			trace.SpanFromContext(ctx).SetAttributes(osmoattr.RolloutID.String(id))
			ctx = osmoattr.ContextWithIDs(ctx, id, "")
		}
	}
	return c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
}
