package telemetry

import (
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
)

// GRPCServerOptions instrument a gRPC server: a server span per call,
// parented on the caller's trace context. Nil when tp is nil.
func GRPCServerOptions(tp trace.TracerProvider, prop propagation.TextMapPropagator) []grpc.ServerOption {
	if tp == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(grpcOptions(tp, prop)...))}
}

// GRPCDialOptions instrument a gRPC client connection: a client span per
// call, whose trace context and baggage go out in the call's metadata. Nil
// when tp is nil.
func GRPCDialOptions(tp trace.TracerProvider, prop propagation.TextMapPropagator) []grpc.DialOption {
	if tp == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(grpcOptions(tp, prop)...))}
}

func grpcOptions(tp trace.TracerProvider, prop propagation.TextMapPropagator) []otelgrpc.Option {
	if prop == nil {
		prop = Propagator()
	}
	return []otelgrpc.Option{
		otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithPropagators(prop),
		// Metrics are Prometheus's job here; no global meter provider.
		otelgrpc.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelgrpc.WithFilter(traced),
	}
}

// traced leaves out calls that are not part of any rollout's story: health
// probes, reflection, and the grade stream, which lives as long as the
// process (each request on it is traced through GradeRequest.trace_context).
func traced(info *stats.RPCTagInfo) bool {
	m := info.FullMethodName
	return m != graderv1.GraderService_GradeStream_FullMethodName &&
		!strings.HasPrefix(m, "/grpc.health.v1.") &&
		!strings.HasPrefix(m, "/grpc.reflection.")
}
