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
//
// The span's name and its http.route attribute are both the request's route
// template (routeOf). otelhttp takes http.route from the request's Pattern,
// which a ServeMux in front of the gateway sets to its own pattern ("/" for
// a gateway mounted at the root): the Pattern is replaced by the route here,
// or cleared for a path the gateway does not serve.
func traced(h http.Handler, tp trace.TracerProvider, prop propagation.TextMapPropagator) http.Handler {
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	inner := otelhttp.NewHandler(h, "osmo-gateway",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(prop),
		// Prometheus has the metrics; no global meter provider.
		otelhttp.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelhttp.WithSpanNameFormatter(spanName))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if route := routeOf(r); r.Pattern != route {
			r = r.WithContext(r.Context()) // a shallow copy: the caller's request stays as it was
			r.Pattern = route
		}
		inner.ServeHTTP(w, r)
	})
}

// spanName names a request's span after its route, never after ids in its
// path: "POST /v1/rollout/init", "GET /v1/rollouts/{rollout_id}",
// "POST /rollout", "GET /rollout/{rollout_id}/status", the
// procedure of an RPC ("/osmo.rollout.v1.RolloutService/InitRollout"), or
// just the method for paths the gateway does not serve.
func spanName(_ string, r *http.Request) string {
	route := routeOf(r)
	switch {
	case isProcedure(route):
		return route
	case route != "":
		return r.Method + " " + route
	}
	return r.Method
}

// routeOf is the route template of the request's path (the http.route of
// its span): a REST route as the API declares it ("/v1/rollouts/{rollout_id}"),
// the path of an RPC procedure, or "" for a path the gateway does not serve.
// It reads the escaped path, as the REST mux matches: an id holding an
// escaped '/' is one segment.
func routeOf(r *http.Request) string {
	p := r.URL.EscapedPath()
	switch {
	case isProcedure(p):
		return p
	case p == "/v1/rollout/init" || p == "/v1/rollouts:watch" || p == "/v1/grade" ||
		p == "/rollout" || p == "/rollout/cancel" ||
		p == "/health" || p == "/platform/health" || p == "/openapi.json":
		return p
	}
	if id, ok := strings.CutPrefix(p, "/v1/rollouts/"); ok && isSegment(id) {
		return "/v1/rollouts/{rollout_id}"
	}
	if rest, ok := strings.CutPrefix(p, "/rollout/"); ok {
		if id, ok := strings.CutSuffix(rest, "/status"); ok && isSegment(id) {
			return "/rollout/{rollout_id}/status"
		}
	}
	return ""
}

// isSegment: s is one non-empty path segment.
func isSegment(s string) bool { return s != "" && !strings.Contains(s, "/") }

// isProcedure: p is the path of an RPC procedure ("/package.Service/Method").
func isProcedure(p string) bool {
	if !strings.HasPrefix(p, "/osmo.") && !strings.HasPrefix(p, "/grpc.") {
		return false
	}
	service, method, ok := strings.Cut(p[1:], "/")
	return ok && isSegment(service) && isSegment(method)
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
