package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// setenv makes env the process's tracing settings for the test: Setup,
// like the OpenTelemetry SDK, reads the process environment.
func setenv(t *testing.T, env map[string]string) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "OTEL_") || strings.HasPrefix(k, "OSMO_TRACE") {
			t.Setenv(k, "")
		}
	}
	for k, v := range env {
		t.Setenv(k, v)
	}
}

func TestSetupOff(t *testing.T) {
	for name, env := range map[string]map[string]string{
		"nothing set":            {},
		"only a service name":    {"OTEL_SERVICE_NAME": "svc", "OTEL_TRACES_SAMPLER": "always_on"},
		"SDK disabled":           {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
		"exporter none":          {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
		"content without export": {"OSMO_TRACE_CONTENT": "true"},
	} {
		t.Run(name, func(t *testing.T) {
			setenv(t, env)
			before := runtime.NumGoroutine()
			tel, err := telemetry.Setup(testContext(t), "osmo-test")
			if err != nil {
				t.Fatal(err)
			}
			if tel.Enabled() || tel.TracerProvider() != nil || tel.ServiceTracerProvider("other") != nil || tel.CaptureContent() {
				t.Errorf("tracing is on: enabled %v, content %v", tel.Enabled(), tel.CaptureContent())
			}
			if after := runtime.NumGoroutine(); after > before {
				t.Errorf("Setup started %d goroutines with tracing off", after-before)
			}
			if got := telemetry.GRPCServerOptions(tel.TracerProvider(), tel.Propagator()); got != nil {
				t.Errorf("GRPCServerOptions = %v with tracing off, want none", got)
			}
			if got := telemetry.GRPCDialOptions(tel.TracerProvider(), tel.Propagator()); got != nil {
				t.Errorf("GRPCDialOptions = %v with tracing off, want none", got)
			}
			if err := tel.Shutdown(testContext(t)); err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			// The propagator still works: a trace passing through is kept.
			fields := tel.Propagator().Fields()
			if len(fields) != 3 {
				t.Errorf("propagator fields %v, want traceparent, tracestate and baggage", fields)
			}
		})
	}
}

// TestSetupRejectsBadSettings: a setting that chooses no exporter, or a
// value osmo itself reads that it cannot use, stops Setup with an error
// naming the variable.
func TestSetupRejectsBadSettings(t *testing.T) {
	for _, tc := range []struct {
		name, value string
	}{
		{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"},
		{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "udp"},
		{"OTEL_TRACES_EXPORTER", "zipkin"},
		{"OTEL_RESOURCE_ATTRIBUTES", "novalue"},
		{"OTEL_SDK_DISABLED", "maybe"},
		{"OSMO_TRACE_CONTENT", "yes please"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			setenv(t, map[string]string{tc.name: tc.value, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
			tel, err := telemetry.Setup(testContext(t), "osmo-test")
			if err == nil {
				_ = tel.Shutdown(testContext(t))
				t.Fatalf("Setup accepted %s=%q", tc.name, tc.value)
			}
			if !strings.Contains(err.Error(), tc.name) {
				t.Errorf("error %q does not name %s", err, tc.name)
			}
		})
	}
}

func TestServiceName(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		want string
	}{
		{"default", map[string]string{}, "osmo-test"},
		{"resource attribute", map[string]string{"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,team=rl"}, "from-attrs"},
		{"OTEL_SERVICE_NAME wins", map[string]string{"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs", "OTEL_SERVICE_NAME": "from-name"}, "from-name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:4318"
			setenv(t, tc.env)
			tel, err := telemetry.Setup(testContext(t), "osmo-test")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tel.Shutdown(context.Background()) })
			if got := tel.ServiceName(); got != tc.want {
				t.Errorf("ServiceName = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestSetupExports sends spans from two services of one process to a
// loopback OTLP receiver over each protocol and checks what arrives.
func TestSetupExports(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sink     func(*testing.T) *sink
		env      func(addr string) map[string]string
		wantPath string
		header   string // the header name as the receiver sees it
	}{
		{
			name: "http/protobuf base endpoint",
			sink: startHTTPSink,
			env: func(addr string) map[string]string {
				return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + addr, "OTEL_EXPORTER_OTLP_HEADERS": "x-team=rl%20infra"}
			},
			wantPath: "/v1/traces",
			header:   "X-Team",
		},
		{
			name: "http/protobuf traces endpoint used as given",
			sink: startHTTPSink,
			env: func(addr string) map[string]string {
				return map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://" + addr + "/collector/traces", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-team=rl%20infra"}
			},
			wantPath: "/collector/traces",
			header:   "X-Team",
		},
		{
			name: "grpc",
			sink: startGRPCSink,
			env: func(addr string) map[string]string {
				return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + addr, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_HEADERS": "x-team=rl%20infra"}
			},
			header: "x-team",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testContext(t)
			s := tc.sink(t)
			setenv(t, tc.env(s.addr))
			tel, err := telemetry.Setup(ctx, "osmo-test")
			if err != nil {
				t.Fatal(err)
			}
			if !tel.Enabled() {
				t.Fatalf("tracing is off with %v", tc.env(s.addr))
			}
			rctx := osmoattr.ContextWithIDs(ctx, "r-1", "s-1")
			_, span := tel.TracerProvider().Tracer("test").Start(rctx, "first")
			span.End()
			_, span = tel.ServiceTracerProvider("osmo-other").Tracer("test").Start(rctx, "second")
			span.End()
			_, span = tel.ServiceTracerProvider("osmo-proxy").Tracer("test").Start(rctx, "third")
			span.End()
			if s.count() != 0 {
				t.Errorf("spans were exported before the batch delay or a flush")
			}
			if err := tel.Shutdown(ctx); err != nil {
				t.Fatalf("Shutdown: %v", err)
			}
			got := map[string]exported{}
			for _, e := range s.wait(t, 3) {
				got[e.name] = e
			}
			for name, service := range map[string]string{"first": "osmo-test", "second": "osmo-other", "third": "osmo-proxy"} {
				e, ok := got[name]
				switch {
				case !ok:
					t.Errorf("span %q was not exported", name)
				case e.service != service:
					t.Errorf("span %q belongs to %q, want %q", name, e.service, service)
				case e.attrs["osmo.rollout.id"] != "r-1" || e.attrs["osmo.sample.id"] != "s-1":
					t.Errorf("span %q attributes %v lack the ids from the baggage", name, e.attrs)
				case e.path != tc.wantPath:
					t.Errorf("exported to path %q, want %q", e.path, tc.wantPath)
				case e.header[tc.header] != "rl infra":
					t.Errorf("export header %s = %q, want %q (headers %v)", tc.header, e.header[tc.header], "rl infra", e.header)
				}
			}
			if err := tel.Shutdown(ctx); err != nil {
				t.Errorf("second Shutdown: %v", err)
			}
			if tel.TracerProvider() != nil || tel.ServiceTracerProvider("osmo-proxy") != nil {
				t.Error("a provider is handed out after Shutdown")
			}
		})
	}
}

func TestBatchFlushesFullBatches(t *testing.T) {
	ctx := testContext(t)
	s := startHTTPSink(t)
	setenv(t, map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT":    "http://" + s.addr,
		"OTEL_BSP_SCHEDULE_DELAY":        "3600000",
		"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "3",
	})
	tel, err := telemetry.Setup(ctx, "osmo-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Shutdown(context.Background()) })
	tr := tel.TracerProvider().Tracer("test")
	for range 3 {
		_, span := tr.Start(ctx, "batched")
		span.End()
	}
	// A full batch goes out at once, not after the hour-long delay.
	if got := len(s.wait(t, 3)); got != 3 {
		t.Errorf("exported %d spans, want the batch of 3", got)
	}
}

func TestSampler(t *testing.T) {
	remoteUnsampled := trace.ContextWithRemoteSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, Remote: true,
	}))
	for _, tc := range []struct {
		name    string
		env     map[string]string
		ctx     context.Context
		sampled bool
	}{
		{"default samples roots", nil, context.Background(), true},
		{"default follows an unsampled parent", nil, remoteUnsampled, false},
		{"always_on ignores the parent", map[string]string{"OTEL_TRACES_SAMPLER": "always_on"}, remoteUnsampled, true},
		{"always_off", map[string]string{"OTEL_TRACES_SAMPLER": "always_off"}, context.Background(), false},
		{"ratio 0", map[string]string{"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, context.Background(), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A sink that is never read: only the sampling decision matters.
			s := startHTTPSink(t)
			env := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + s.addr}
			for k, v := range tc.env {
				env[k] = v
			}
			setenv(t, env)
			tel, err := telemetry.Setup(testContext(t), "osmo-test")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tel.Shutdown(context.Background()) })
			_, span := tel.TracerProvider().Tracer("test").Start(tc.ctx, "x")
			defer span.End()
			if got := span.SpanContext().IsSampled(); got != tc.sampled {
				t.Errorf("sampled = %v, want %v", got, tc.sampled)
			}
		})
	}
}

func TestBaggageAttributes(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tr := tp.Tracer("test")
	for _, tc := range []struct {
		name              string
		ctx               context.Context
		rollout, sampleID string
	}{
		{"both ids", osmoattr.ContextWithIDs(context.Background(), "r-1", "s-1"), "r-1", "s-1"},
		{"rollout only", osmoattr.ContextWithIDs(context.Background(), "r-2", ""), "r-2", ""},
		{"no baggage", context.Background(), "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp.Reset()
			_, span := tr.Start(tc.ctx, "x")
			span.End()
			spans := exp.GetSpans()
			if len(spans) != 1 {
				t.Fatalf("%d spans", len(spans))
			}
			got := map[string]string{}
			for _, kv := range spans[0].Attributes {
				got[string(kv.Key)] = kv.Value.AsString()
			}
			if got["osmo.rollout.id"] != tc.rollout || got["osmo.sample.id"] != tc.sampleID {
				t.Errorf("attributes %v, want rollout %q sample %q", got, tc.rollout, tc.sampleID)
			}
		})
	}
	// The ids travel with the trace context.
	carrier := propagation.MapCarrier{}
	telemetry.Propagator().Inject(osmoattr.ContextWithIDs(context.Background(), "r 3", "s/3"), carrier)
	back := telemetry.Propagator().Extract(context.Background(), carrier)
	_, span := tr.Start(back, "remote")
	span.End()
	spans := exp.GetSpans()
	last := spans[len(spans)-1]
	got := map[string]string{}
	for _, kv := range last.Attributes {
		got[string(kv.Key)] = kv.Value.AsString()
	}
	if got["osmo.rollout.id"] != "r 3" || got["osmo.sample.id"] != "s/3" {
		t.Errorf("after propagation the span has %v, want the ids r 3 and s/3", got)
	}
}

func TestLogHandler(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(telemetry.LogHandler(slog.NewJSONHandler(&buf, nil))).With("rollout_id", "r-1")
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, span := tp.Tracer("test").Start(context.Background(), "x")
	defer span.End()

	line := func() map[string]any {
		t.Helper()
		var m map[string]any
		if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", buf.String(), err)
		}
		buf.Reset()
		return m
	}
	log.InfoContext(ctx, "traced")
	m := line()
	if m["trace_id"] != span.SpanContext().TraceID().String() || m["span_id"] != span.SpanContext().SpanID().String() {
		t.Errorf("traced record %v lacks the span's ids", m)
	}
	if m["rollout_id"] != "r-1" {
		t.Errorf("record %v lost the logger's attributes", m)
	}
	log.Info("untraced")
	if m := line(); m["trace_id"] != nil || m["span_id"] != nil {
		t.Errorf("untraced record %v has trace ids", m)
	}
	log.WithGroup("g").InfoContext(ctx, "grouped", "k", "v")
	if m := line(); m["g"] == nil {
		t.Errorf("grouped record %v lost its group", m)
	}
}

// TestGRPCOptions checks gRPC calls are traced, but not health checks or
// the grade stream.
func TestGRPCOptions(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(telemetry.GRPCServerOptions(tp, nil)...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	graderv1.RegisterGraderServiceServer(srv, graderv1.UnimplementedGraderServiceServer{})
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	conn, err := grpc.NewClient(ln.Addr().String(), append(telemetry.GRPCDialOptions(tp, nil), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ctx := testContext(t)

	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	gc := graderv1.NewGraderServiceClient(conn)
	if _, err := gc.Grade(ctx, &graderv1.GradeRequest{}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("Grade: %v", err)
	}
	stream, err := gc.GradeStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unimplemented {
		t.Fatalf("GradeStream: %v", err)
	}

	// The server span ends after the status is written, so the client can
	// see the answer first: wait (bounded) for both spans.
	var kinds map[string][]trace.SpanKind
	for deadline := time.Now().Add(5 * time.Second); ; {
		kinds = map[string][]trace.SpanKind{}
		for _, s := range exp.GetSpans() {
			kinds[s.Name] = append(kinds[s.Name], s.SpanKind)
		}
		if len(kinds["osmo.grader.v1.GraderService/Grade"]) >= 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := kinds["osmo.grader.v1.GraderService/Grade"]; len(got) != 2 {
		t.Errorf("Grade spans %v, want a client and a server span", got)
	}
	for name := range kinds {
		if name != "osmo.grader.v1.GraderService/Grade" {
			t.Errorf("unexpected span %q (health checks and the grade stream are not traced)", name)
		}
	}
}

// TestExportErrorsAreLogged: an export the collector refuses is a warning
// in the command's log.
func TestExportErrorsAreLogged(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no such tenant", http.StatusBadRequest)
	}))
	defer srv.Close()
	ctx := testContext(t)
	setenv(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL})
	tel, err := telemetry.Setup(ctx, "osmo-test")
	if err != nil {
		t.Fatal(err)
	}
	var out logtest.Buffer
	tel.LogErrorsTo(slog.New(slog.NewJSONHandler(&out, nil)))
	_, span := tel.TracerProvider().Tracer("test").Start(ctx, "refused")
	span.End()
	if err := tel.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if !strings.Contains(out.String(), "spans were not exported") || !strings.Contains(out.String(), `"level":"WARN"`) || !strings.Contains(out.String(), "400") {
		t.Errorf("log %s: want a warning naming the collector's status", out.String())
	}
}
