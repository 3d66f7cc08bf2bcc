// Package telemetry sets up OpenTelemetry tracing for the osmo commands from
// the standard OTEL_* environment variables, without touching the global
// OpenTelemetry state: the providers and the propagator it returns are
// passed explicitly to the components that trace.
//
// The exporter comes from autoexport (OTEL_TRACES_EXPORTER, the OTLP
// protocol, endpoint, headers, TLS and compression settings), the batching
// from the SDK's batch span processor (OTEL_BSP_*), the sampler from
// OTEL_TRACES_SAMPLER, the resource from OTEL_RESOURCE_ATTRIBUTES and
// OTEL_SERVICE_NAME: each read by the OpenTelemetry library that uses it.
// What osmo adds is when tracing is on: only when an OTLP endpoint or
// OTEL_TRACES_EXPORTER is set, and not with OTEL_SDK_DISABLED=true or
// OTEL_TRACES_EXPORTER=none. Off means no exporter, no goroutines and nil
// tracer providers, which the components read as "do not instrument".
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
)

// Propagator is the W3C trace context and baggage propagator every osmo
// service uses.
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// Telemetry is the tracing set up for one process. Its providers share one
// exporter; Shutdown flushes them all.
type Telemetry struct {
	serviceName    string
	captureContent bool
	prop           propagation.TextMapPropagator

	// exporter is nil when tracing is off.
	exporter sdktrace.SpanExporter
	res      *resource.Resource // the environment's and the host's, every provider's base

	// errorLog, when set, is where failed exports are reported; otherwise
	// the OpenTelemetry error handler.
	errorLog atomic.Pointer[slog.Logger]

	mu        sync.Mutex
	providers map[string]*sdktrace.TracerProvider
	shutdown  bool
}

// Setup reads the tracing configuration from the process environment and,
// when tracing is on, builds the exporter (which connects lazily, on the
// first export). defaultServiceName is the service.name unless
// OTEL_SERVICE_NAME or a service.name in OTEL_RESOURCE_ATTRIBUTES says
// otherwise. Its errors are all settings it cannot use, each naming its
// variable.
func Setup(ctx context.Context, defaultServiceName string) (*Telemetry, error) {
	cfg, err := readEnv()
	if err != nil {
		return nil, err
	}
	t := &Telemetry{serviceName: defaultServiceName, captureContent: cfg.captureContent, prop: Propagator(),
		providers: map[string]*sdktrace.TracerProvider{}}
	if !cfg.enabled {
		return t, nil
	}
	exp, err := autoexport.NewSpanExporter(ctx)
	if err != nil {
		return nil, fmt.Errorf("telemetry: %s: %w", exporterVars(), err)
	}
	if autoexport.IsNoneSpanExporter(exp) {
		return t, nil
	}
	t.res, err = resource.New(ctx, resource.WithFromEnv(), resource.WithTelemetrySDK(), resource.WithHost(), resource.WithProcessPID())
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, fmt.Errorf("telemetry: OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	if name, ok := t.res.Set().Value(semconv.ServiceNameKey); ok {
		t.serviceName = name.AsString()
	}
	t.exporter = exp
	return t, nil
}

// LogErrorsTo reports failed exports to log, as warnings, instead of the
// OpenTelemetry error handler (which prints to stderr).
func (t *Telemetry) LogErrorsTo(log *slog.Logger) { t.errorLog.Store(log) }

func (t *Telemetry) exportFailed(err error) {
	if log := t.errorLog.Load(); log != nil {
		log.Warn("tracing: spans were not exported", "error", err)
		return
	}
	otel.Handle(err)
}

// Enabled reports whether spans are exported.
func (t *Telemetry) Enabled() bool { return t.exporter != nil }

// ServiceName is the process's service.name.
func (t *Telemetry) ServiceName() string { return t.serviceName }

// CaptureContent reports whether LLM message content may be recorded on
// spans (OSMO_TRACE_CONTENT or OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT).
func (t *Telemetry) CaptureContent() bool { return t.Enabled() && t.captureContent }

// Propagator is the W3C trace context and baggage propagator.
func (t *Telemetry) Propagator() propagation.TextMapPropagator { return t.prop }

// TracerProvider is the provider of the process's service, nil when tracing
// is off.
func (t *Telemetry) TracerProvider() trace.TracerProvider {
	return t.ServiceTracerProvider(t.serviceName)
}

// ServiceTracerProvider is a provider whose spans belong to serviceName and
// share the process's exporter and resource attributes: `osmo serve` runs
// four components in one process and gives each its own, so traces show the
// same services as the split deployment. It is nil when tracing is off or
// after Shutdown.
func (t *Telemetry) ServiceTracerProvider(serviceName string) trace.TracerProvider {
	if !t.Enabled() {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.shutdown {
		return nil
	}
	if tp, ok := t.providers[serviceName]; ok {
		return tp
	}
	res, err := resource.Merge(t.res, resource.NewSchemaless(semconv.ServiceName(serviceName)))
	if err != nil {
		// Only conflicting schema URLs fail a merge, and the second has none.
		res = t.res
	}
	tp := NewTracerProvider(sharedExporter{t.exporter, t.exportFailed}, sdktrace.WithResource(res))
	t.providers[serviceName] = tp
	return tp
}

// NewTracerProvider is the provider osmo traces with: the BaggageAttributes
// processor, then the SDK's batch span processor (OTEL_BSP_*) in front of
// exporter, and the sampler of OTEL_TRACES_SAMPLER; opts may add to or
// override these (a resource, a sampler).
func NewTracerProvider(exporter sdktrace.SpanExporter, opts ...sdktrace.TracerProviderOption) *sdktrace.TracerProvider {
	return sdktrace.NewTracerProvider(append([]sdktrace.TracerProviderOption{
		sdktrace.WithSpanProcessor(BaggageAttributes()),
		sdktrace.WithBatcher(exporter),
	}, opts...)...)
}

// Shutdown exports every provider's buffered spans, then stops the
// exporter; ctx bounds both. It is safe to call more than once and when
// tracing is off.
func (t *Telemetry) Shutdown(ctx context.Context) error {
	if !t.Enabled() {
		return nil
	}
	t.mu.Lock()
	if t.shutdown {
		t.mu.Unlock()
		return nil
	}
	t.shutdown = true
	providers := make([]*sdktrace.TracerProvider, 0, len(t.providers))
	for _, tp := range t.providers {
		providers = append(providers, tp)
	}
	t.mu.Unlock()
	var errs []error
	for _, tp := range providers {
		errs = append(errs, tp.Shutdown(ctx))
	}
	errs = append(errs, t.exporter.Shutdown(ctx))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("telemetry: shutdown: %w", err)
	}
	return nil
}

// sharedExporter lets the batch processors of several providers use one
// exporter: shutting a provider down flushes its spans but leaves the
// exporter to Telemetry. A failed export is reported here, once, rather
// than returned to the batch processor, which would hand it to the global
// error handler as well.
type sharedExporter struct {
	sdktrace.SpanExporter
	failed func(error)
}

func (e sharedExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	if err := e.SpanExporter.ExportSpans(ctx, spans); err != nil {
		e.failed(err)
	}
	return nil
}

func (sharedExporter) Shutdown(context.Context) error { return nil }
