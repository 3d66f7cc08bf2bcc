package otlpdirect_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

var fastRetry = otlpdirect.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxElapsedTime: 5 * time.Second}

// oneSpan runs a provider on exp, ends one span and shuts the provider
// down, returning the export's outcome.
func oneSpan(t *testing.T, exp otlpdirect.Exporter) error {
	t.Helper()
	ctx := context.Background()
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Resource: testResource(t), Batch: otlpdirect.BatchConfig{Delay: time.Hour}})
	_, s := tp.Tracer("test").Start(ctx, "the span")
	s.End()
	err := tp.ForceFlush(ctx)
	if serr := tp.Shutdown(ctx); serr != nil {
		t.Fatal(serr)
	}
	_ = exp.Shutdown(ctx)
	return err
}

func TestHTTPExporter(t *testing.T) {
	t.Run("headers and gzip", func(t *testing.T) {
		sink := newHTTPSink(t)
		exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.url + "/v1/traces", Gzip: true,
			Headers: map[string]string{"Authorization": "Bearer k"}})
		if err := oneSpan(t, exp); err != nil {
			t.Fatal(err)
		}
		req := sink.only(t)
		if countSpans(req) != 1 || req.GetResourceSpans()[0].GetScopeSpans()[0].GetSpans()[0].GetName() != "the span" {
			t.Errorf("received %v", req)
		}
		h := sink.headers[0]
		if h.Get("Authorization") != "Bearer k" || h.Get("Content-Encoding") != "gzip" || h.Get("User-Agent") == "" {
			t.Errorf("headers %v: want the configured Authorization, gzip and a User-Agent", h)
		}
	})
	t.Run("retries 503 and 429", func(t *testing.T) {
		sink := newHTTPSink(t)
		sink.answer = func(n int, w http.ResponseWriter) bool {
			switch n {
			case 0:
				http.Error(w, "busy", http.StatusServiceUnavailable)
				return true
			case 1:
				w.Header().Set("Retry-After", "0")
				http.Error(w, "slow down", http.StatusTooManyRequests)
				return true
			}
			return false
		}
		exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.url + "/v1/traces", Retry: fastRetry})
		if err := oneSpan(t, exp); err != nil {
			t.Fatal(err)
		}
		if n := len(sink.received()); n != 1 || sink.calls != 3 {
			t.Errorf("%d requests kept of %d calls, want 1 of 3", n, sink.calls)
		}
	})
	t.Run("does not retry 400", func(t *testing.T) {
		sink := newHTTPSink(t)
		sink.answer = func(_ int, w http.ResponseWriter) bool {
			http.Error(w, "malformed", http.StatusBadRequest)
			return true
		}
		exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.url + "/v1/traces", Retry: fastRetry})
		err := oneSpan(t, exp)
		if err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "malformed") {
			t.Errorf("error %v: want the status and the collector's message", err)
		}
		if sink.calls != 1 {
			t.Errorf("%d calls, want 1", sink.calls)
		}
	})
	t.Run("partial success is an error", func(t *testing.T) {
		sink := newHTTPSink(t)
		sink.answer = func(_ int, w http.ResponseWriter) bool {
			b, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{PartialSuccess: &coltracepb.ExportTracePartialSuccess{
				RejectedSpans: 1, ErrorMessage: "span too old"}})
			_, _ = w.Write(b)
			return true
		}
		exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.url + "/v1/traces"})
		if err := oneSpan(t, exp); err == nil || !strings.Contains(err.Error(), "rejected 1 spans: span too old") {
			t.Errorf("error %v, want the rejection", err)
		}
	})
	t.Run("gives up when the export times out", func(t *testing.T) {
		sink := newHTTPSink(t)
		sink.answer = func(_ int, w http.ResponseWriter) bool {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return true
		}
		exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.url + "/v1/traces",
			Retry: otlpdirect.RetryConfig{InitialInterval: 10 * time.Millisecond, MaxElapsedTime: time.Hour}})
		ctx := context.Background()
		tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Batch: otlpdirect.BatchConfig{Delay: time.Hour, ExportTimeout: 200 * time.Millisecond}})
		defer tp.Shutdown(ctx)
		_, s := tp.Tracer("test").Start(ctx, "s")
		s.End()
		start := time.Now()
		err := tp.ForceFlush(ctx)
		if err == nil || !strings.Contains(err.Error(), "503") {
			t.Errorf("error %v, want the last 503", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the export took %s, past its 200ms timeout", d)
		}
	})
}

// grpcSink is an OTLP/gRPC receiver on loopback; it fails the first
// failFirst calls with Unavailable.
type grpcSink struct {
	coltracepb.UnimplementedTraceServiceServer
	addr      string
	failFirst int

	mu       sync.Mutex
	calls    int
	requests []*coltracepb.ExportTraceServiceRequest
	md       []metadata.MD
}

func newGRPCSink(t *testing.T, failFirst int) *grpcSink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &grpcSink{addr: ln.Addr().String(), failFirst: failFirst}
	srv := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(srv, s)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return s
}

func (s *grpcSink) Export(ctx context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if s.calls <= s.failFirst {
		return nil, status.Error(codes.Unavailable, "starting up")
	}
	md, _ := metadata.FromIncomingContext(ctx)
	s.requests = append(s.requests, req)
	s.md = append(s.md, md)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func TestGRPCExporter(t *testing.T) {
	sink := newGRPCSink(t, 2)
	exp, err := otlpdirect.NewGRPCExporter(otlpdirect.GRPCConfig{Target: sink.addr, Insecure: true, Gzip: true,
		Headers: map[string]string{"authorization": "Bearer k"}, Retry: fastRetry})
	if err != nil {
		t.Fatal(err)
	}
	if err := oneSpan(t, exp); err != nil {
		t.Fatal(err)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if sink.calls != 3 || len(sink.requests) != 1 {
		t.Fatalf("%d calls, %d requests kept: want 2 Unavailable retried, then 1", sink.calls, len(sink.requests))
	}
	if countSpans(sink.requests[0]) != 1 {
		t.Errorf("received %v", sink.requests[0])
	}
	if got := sink.md[0].Get("authorization"); len(got) != 1 || got[0] != "Bearer k" {
		t.Errorf("authorization metadata %v", got)
	}
	if got := sink.md[0].Get("grpc-accept-encoding"); len(got) == 0 || !strings.Contains(got[0], "gzip") {
		t.Errorf("grpc-accept-encoding %v: want gzip", got)
	}
}

func TestGRPCExporterDoesNotRetryInvalidArgument(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	calls := 0
	coltracepb.RegisterTraceServiceServer(srv, rejectAll{calls: &calls})
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	exp, err := otlpdirect.NewGRPCExporter(otlpdirect.GRPCConfig{Target: ln.Addr().String(), Insecure: true, Retry: fastRetry})
	if err != nil {
		t.Fatal(err)
	}
	if err := oneSpan(t, exp); status.Code(err) != codes.InvalidArgument {
		t.Errorf("error %v, want InvalidArgument", err)
	}
	if calls != 1 {
		t.Errorf("%d calls, want 1", calls)
	}
}

type rejectAll struct {
	coltracepb.UnimplementedTraceServiceServer
	calls *int
}

func (r rejectAll) Export(context.Context, *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	*r.calls++
	return nil, status.Error(codes.InvalidArgument, "bad span")
}
