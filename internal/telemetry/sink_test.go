package telemetry_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// exported is one span a sink received.
type exported struct {
	service string
	name    string
	attrs   map[string]string // string values only
	header  map[string]string // the export request's headers/metadata
	path    string            // HTTP path of the export (OTLP/HTTP)
}

// sink is an OTLP receiver on loopback, over HTTP or gRPC.
type sink struct {
	addr string // host:port

	mu      sync.Mutex
	spans   []exported
	changed chan struct{}
}

func newSink() *sink { return &sink{changed: make(chan struct{})} }

func (s *sink) add(req *coltracepb.ExportTraceServiceRequest, header map[string]string, path string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				attrs := map[string]string{}
				for _, kv := range sp.GetAttributes() {
					attrs[kv.GetKey()] = kv.GetValue().GetStringValue()
				}
				s.spans = append(s.spans, exported{service: service, name: sp.GetName(), attrs: attrs, header: header, path: path})
			}
		}
	}
	close(s.changed)
	s.changed = make(chan struct{})
}

// wait returns the spans once at least n arrived, or fails the test.
func (s *sink) wait(t *testing.T, n int) []exported {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		s.mu.Lock()
		spans, changed := append([]exported(nil), s.spans...), s.changed
		s.mu.Unlock()
		if len(spans) >= n {
			return spans
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("sink got %d spans, want %d", len(spans), n)
		}
	}
}

func (s *sink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.spans)
}

// startHTTPSink accepts OTLP/HTTP protobuf exports on any path.
func startHTTPSink(t *testing.T) *sink {
	t.Helper()
	s := newSink()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		req := &coltracepb.ExportTraceServiceRequest{}
		if err := proto.Unmarshal(body, req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		header := map[string]string{}
		for k := range r.Header {
			header[k] = r.Header.Get(k)
		}
		s.add(req, header, r.URL.Path)
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	s.addr = srv.Listener.Addr().String()
	return s
}

type grpcSink struct {
	coltracepb.UnimplementedTraceServiceServer
	s *sink
}

func (g grpcSink) Export(ctx context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	header := map[string]string{}
	for k, v := range md {
		header[k] = v[0]
	}
	g.s.add(req, header, "")
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// startGRPCSink accepts OTLP/gRPC exports.
func startGRPCSink(t *testing.T) *sink {
	t.Helper()
	s := newSink()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, grpcSink{s: s})
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(ln) }()
	t.Cleanup(func() { gs.Stop(); <-done })
	s.addr = ln.Addr().String()
	return s
}
