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

// traced wraps h in an HTTP server span per request, continuing the
// caller's trace. otelhttp takes http.route from the request's Pattern,
// which a ServeMux in front may have set to its own: it is replaced by the
// route (routeOf).
func traced(h http.Handler, tp trace.TracerProvider, prop propagation.TextMapPropagator) http.Handler {
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	inner := otelhttp.NewHandler(h, "osmo-gateway",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(prop),
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

// spanName names a request's span after its route, never after ids in
// its path: "GET /v1/rollouts/{rollout_id}", an RPC's procedure, or just
// the method for paths the gateway does not serve.
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

// routeOf is the route template of the request's path, or "" for a path
// the gateway does not serve. It reads the escaped path, as the REST mux
// matches.
func routeOf(r *http.Request) string {
	p := r.URL.EscapedPath()
	switch {
	case isProcedure(p):
		return p
	case p == "/v1/rollout/init" || p == "/v1/rollouts:watch" || p == rowsStreamPath || p == "/v1/grade" ||
		p == "/rollout" || p == "/rollout/cancel" ||
		p == "/health" || p == "/platform/health" || p == "/openapi.json",
		p == "/v1/policy" || p == "/v1/policy/pause" || p == "/v1/policy/resume":
		return p
	}
	if id, ok := strings.CutPrefix(p, "/v1/rollouts/"); ok && isSegment(id) {
		return "/v1/rollouts/{rollout_id}"
	}
	if rest, ok := strings.CutPrefix(p, "/v1/rollouts/"); ok {
		if id, ok := strings.CutSuffix(rest, "/rows"); ok && isSegment(id) {
			return "/v1/rollouts/{rollout_id}/rows"
		}
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

// rolloutIDConn tags the request's span with the id of a rollout being
// started and puts it into the baggage, so every span of the call carries
// osmo.rollout.id.
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
