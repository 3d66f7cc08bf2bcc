// Package telemetry sets up OpenTelemetry tracing for the osmo commands from
// the standard environment variables, without touching the global
// OpenTelemetry state: the providers and the propagator it returns are
// passed explicitly to the components that trace.
//
// Tracing is off unless an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set or OTEL_TRACES_EXPORTER=otlp;
// OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off. Off means
// no exporter, no goroutines and nil tracer providers, which the components
// read as "do not instrument".
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// Propagator is the W3C trace context and baggage propagator every osmo
// service uses.
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, osmoattr.NewBaggagePropagator())
}

// Telemetry is the tracing set up for one process. Its providers share one
// exporter; Shutdown flushes them all.
type Telemetry struct {
	cfg  *config
	prop propagation.TextMapPropagator
	base *resource.Resource // what every provider's resource starts from

	// exporter is nil when tracing is off; direct is the direct span
	// pipeline's, nil as well when OSMO_TRACE_PIPELINE=sdk.
	exporter sdktrace.SpanExporter
	direct   otlpdirect.Exporter

	// errorLog, when set, is where failed exports are reported; otherwise
	// the OpenTelemetry error handler.
	errorLog atomic.Pointer[slog.Logger]

	mu        sync.Mutex
	providers map[string]*sdktrace.TracerProvider
	directs   map[string]*otlpdirect.TracerProvider
	shutdown  bool
}

// Setup reads the tracing configuration through getenv (os.Getenv in
// production) and, when tracing is on, builds the OTLP exporter (which
// connects lazily, on the first export). defaultServiceName is the
// service.name unless OTEL_SERVICE_NAME or a service.name in
// OTEL_RESOURCE_ATTRIBUTES says otherwise. Invalid values are an *EnvError.
//
// Span limits (OTEL_SPAN_*) are read by the SDK from the process
// environment, as are the exporters' TLS and compression settings
// (OTEL_EXPORTER_OTLP_CERTIFICATE, ..._COMPRESSION).
func Setup(ctx context.Context, defaultServiceName string, getenv func(string) string) (*Telemetry, error) {
	cfg, err := readConfig(defaultServiceName, getenv)
	if err != nil {
		return nil, err
	}
	t := &Telemetry{cfg: cfg, prop: Propagator(), providers: map[string]*sdktrace.TracerProvider{}, directs: map[string]*otlpdirect.TracerProvider{}}
	if !cfg.enabled {
		return t, nil
	}
	// The SDK's own detectors only, not resource.Default(): that one reads
	// OTEL_* from the process environment rather than through getenv.
	if t.base, err = resource.New(ctx, resource.WithTelemetrySDK(), resource.WithHost(), resource.WithProcessPID()); err != nil {
		return nil, fmt.Errorf("telemetry: resource: %w", err)
	}
	if t.exporter, err = newExporter(ctx, cfg); err != nil {
		return nil, err
	}
	if cfg.pipeline == PipelineDirect {
		if t.direct, err = newDirectExporter(cfg); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// newDirectExporter is the direct pipeline's OTLP exporter, configured as
// the SDK's.
func newDirectExporter(cfg *config) (otlpdirect.Exporter, error) {
	if cfg.protocol == ProtocolGRPC {
		return otlpdirect.NewGRPCExporter(otlpdirect.GRPCConfig{
			Target: cfg.endpoint.Host, Insecure: cfg.endpoint.Scheme == "http", TLS: cfg.tls,
			Headers: cfg.headers, Gzip: cfg.gzip, Timeout: cfg.timeout,
		})
	}
	return otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{
		URL: cfg.endpoint.String(), TLS: cfg.tls, Headers: cfg.headers, Gzip: cfg.gzip, Timeout: cfg.timeout,
	}), nil
}

func newExporter(ctx context.Context, cfg *config) (sdktrace.SpanExporter, error) {
	insecure := cfg.endpoint.Scheme == "http"
	switch cfg.protocol {
	case ProtocolGRPC:
		opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(cfg.endpoint.Host)}
		if insecure {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		if len(cfg.headers) > 0 {
			opts = append(opts, otlptracegrpc.WithHeaders(cfg.headers))
		}
		if cfg.timeout > 0 {
			opts = append(opts, otlptracegrpc.WithTimeout(cfg.timeout))
		}
		exp, err := otlptracegrpc.New(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("telemetry: OTLP/gRPC exporter: %w", err)
		}
		return exp, nil
	default:
		opts := []otlptracehttp.Option{otlptracehttp.WithEndpoint(cfg.endpoint.Host), otlptracehttp.WithURLPath(cfg.endpoint.Path)}
		if insecure {
			opts = append(opts, otlptracehttp.WithInsecure())
		}
		if len(cfg.headers) > 0 {
			opts = append(opts, otlptracehttp.WithHeaders(cfg.headers))
		}
		if cfg.timeout > 0 {
			opts = append(opts, otlptracehttp.WithTimeout(cfg.timeout))
		}
		exp, err := otlptracehttp.New(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("telemetry: OTLP/HTTP exporter: %w", err)
		}
		return exp, nil
	}
}

// LogErrorsTo reports failed exports and dropped spans to log, as
// warnings, instead of the OpenTelemetry error handler (which prints to
// stderr).
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
func (t *Telemetry) ServiceName() string { return t.cfg.serviceName }

// Endpoint describes where spans go ("" when tracing is off), for logs.
func (t *Telemetry) Endpoint() string {
	if !t.Enabled() {
		return ""
	}
	return t.cfg.protocol + " " + t.cfg.endpoint.String()
}

// CaptureContent reports whether LLM message content may be recorded on
// spans (OSMO_TRACE_CONTENT or OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT).
func (t *Telemetry) CaptureContent() bool { return t.Enabled() && t.cfg.captureContent }

// Propagator is the W3C trace context and baggage propagator.
func (t *Telemetry) Propagator() propagation.TextMapPropagator { return t.prop }

// TracerProvider is the provider of the process's service, nil when tracing
// is off.
func (t *Telemetry) TracerProvider() trace.TracerProvider {
	return t.ServiceTracerProvider(t.cfg.serviceName)
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
	tp := newTracerProvider(sharedExporter{t.exporter}, t.resource(serviceName), t.cfg.sampler, t.cfg.batch, t.exportFailed)
	t.providers[serviceName] = tp
	return tp
}

// DirectTracerProvider is a provider for a hot path, the LLM proxy's
// per-call span: its spans are encoded as they end and exported in batches
// of bytes (package otlpdirect), for a fraction of the SDK's CPU per span.
// Like ServiceTracerProvider, its spans belong to serviceName, carry the ids
// in the parent's baggage (BaggageAttributes) and go to the same endpoint,
// sampled by the same sampler. With OSMO_TRACE_PIPELINE=sdk it is
// ServiceTracerProvider(serviceName). It is nil when tracing is off or
// after Shutdown.
func (t *Telemetry) DirectTracerProvider(serviceName string) trace.TracerProvider {
	if t.direct == nil {
		return t.ServiceTracerProvider(serviceName)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.shutdown {
		return nil
	}
	if tp, ok := t.directs[serviceName]; ok {
		return tp
	}
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{
		Exporter:        t.direct,
		Resource:        t.resource(serviceName),
		Sampler:         t.cfg.sampler,
		Batch:           t.cfg.batch,
		StartAttributes: baggageIDs,
		OnError:         t.exportFailed,
	})
	t.directs[serviceName] = tp
	return tp
}

// resource is the resource of serviceName's spans.
func (t *Telemetry) resource(serviceName string) *resource.Resource {
	attrs := append([]attribute.KeyValue{semconv.ServiceName(serviceName)}, t.cfg.resource...)
	res, err := resource.Merge(t.base, resource.NewSchemaless(attrs...))
	if err != nil {
		// Only conflicting schema URLs fail a merge, and ours has none.
		res = resource.NewSchemaless(attrs...)
	}
	return res
}

// NewTracerProvider is the SDK provider osmo uses: sampler (nil means
// parent-based always-on), the BaggageAttributes processor and a batch
// processor (default OTEL_BSP_* settings) in front of exporter. Setup
// builds its providers the same way; tests and benchmarks may use it too.
func NewTracerProvider(exporter sdktrace.SpanExporter, res *resource.Resource, sampler sdktrace.Sampler) *sdktrace.TracerProvider {
	return newTracerProvider(exporter, res, sampler, otlpdirect.BatchConfig{}, otel.Handle)
}

func newTracerProvider(exporter sdktrace.SpanExporter, res *resource.Resource, sampler sdktrace.Sampler, bc otlpdirect.BatchConfig, onError func(error)) *sdktrace.TracerProvider {
	if sampler == nil {
		sampler = sdktrace.ParentBased(sdktrace.AlwaysSample())
	}
	opts := []sdktrace.TracerProviderOption{
		sdktrace.WithSampler(sampler),
		sdktrace.WithSpanProcessor(BaggageAttributes()),
		sdktrace.WithSpanProcessor(newBatcher(exporter, bc, onError)),
	}
	if res != nil {
		opts = append(opts, sdktrace.WithResource(res))
	}
	return sdktrace.NewTracerProvider(opts...)
}

// Shutdown flushes every provider's buffered spans, then stops the exporter.
// It is safe to call more than once and when tracing is off.
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
	providers := make([]interface{ Shutdown(context.Context) error }, 0, len(t.providers)+len(t.directs))
	for _, tp := range t.providers {
		providers = append(providers, tp)
	}
	for _, tp := range t.directs {
		providers = append(providers, tp)
	}
	t.mu.Unlock()
	var errs []error
	for _, tp := range providers {
		if err := tp.Shutdown(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if err := t.exporter.Shutdown(ctx); err != nil {
		errs = append(errs, err)
	}
	if t.direct != nil {
		if err := t.direct.Shutdown(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("telemetry: shutdown: %w", err)
	}
	return nil
}

// sharedExporter lets several batch processors use one exporter: shutting a
// provider down flushes its spans but leaves the exporter to Telemetry.
type sharedExporter struct{ sdktrace.SpanExporter }

func (sharedExporter) Shutdown(context.Context) error { return nil }
