package cli

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry"
)

// Service names on spans. `osmo serve` gives each component its own, so a
// trace shows the same services whether the stack runs in one process or
// split; a split command's own name can be changed with OTEL_SERVICE_NAME.
const (
	serviceGateway  = "osmo-gateway"
	serviceRollout  = "osmo-rollout"
	serviceLLMProxy = "osmo-llmproxy"
	serviceGrader   = "osmo-grader"
)

// start builds a command's logger, and its tracing for service from the
// process environment, which the OpenTelemetry SDK reads; failed exports
// are logged. The returned func flushes the last spans (within 10s): call
// it once everything that makes spans has stopped.
func (l *logFlags) start(ctx context.Context, e *env, service string) (*slog.Logger, *telemetry.Telemetry, func(), error) {
	log, err := l.logger(e.stderr)
	if err != nil {
		return nil, nil, nil, err
	}
	tel, err := telemetry.Setup(ctx, service)
	if err != nil {
		return nil, nil, nil, usageError{err.Error()}
	}
	tel.LogErrorsTo(log)
	if tel.Enabled() {
		log.Info("tracing on", "service", tel.ServiceName(), "exporter", cmp.Or(e.getenv("OTEL_TRACES_EXPORTER"), "otlp"),
			"endpoint", cmp.Or(e.getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), e.getenv("OTEL_EXPORTER_OTLP_ENDPOINT")),
			"capture_content", tel.CaptureContent())
	}
	return log, tel, func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := tel.Shutdown(sctx); err != nil {
			log.Warn("tracing: the last spans were not all exported", "error", err)
		}
	}, nil
}

// tracing is what the components of a command trace with; the providers
// are nil when tracing is off, which the components read as "do not trace".
type tracing struct {
	gateway, rollout, proxy, grader trace.TracerProvider
	prop                            propagation.TextMapPropagator
	content                         bool
}

// stackTracing gives every component of `osmo serve` its own service.
func stackTracing(tel *telemetry.Telemetry) tracing {
	return tracing{
		gateway: tel.ServiceTracerProvider(serviceGateway),
		rollout: tel.ServiceTracerProvider(serviceRollout),
		proxy:   tel.ServiceTracerProvider(serviceLLMProxy),
		grader:  tel.ServiceTracerProvider(serviceGrader),
		prop:    tel.Propagator(),
		content: tel.CaptureContent(),
	}
}
