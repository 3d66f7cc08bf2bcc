package otlpdirect_test

import (
	"compress/gzip"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// httpSink is an OTLP/HTTP receiver on loopback that keeps every request.
// Its answer can be set per request, to play a collector that fails.
type httpSink struct {
	url string

	mu       sync.Mutex
	requests []*coltracepb.ExportTraceServiceRequest
	headers  []http.Header
	// answer, when set, answers the request numbered n (from 0) instead
	// of a plain 200; handled reports whether it did.
	answer func(n int, w http.ResponseWriter) (handled bool)
	calls  int
}

func newHTTPSink(t *testing.T) *httpSink {
	t.Helper()
	s := &httpSink{}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

func (s *httpSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want POST /v1/traces of application/x-protobuf", http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	n := s.calls
	s.calls++
	answer := s.answer
	s.mu.Unlock()
	if answer != nil && answer(n, w) {
		return
	}
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = zr
	}
	b, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req := &coltracepb.ExportTraceServiceRequest{}
	if err := proto.Unmarshal(b, req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	s.requests = append(s.requests, req)
	s.headers = append(s.headers, r.Header.Clone())
	s.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (s *httpSink) received() []*coltracepb.ExportTraceServiceRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*coltracepb.ExportTraceServiceRequest(nil), s.requests...)
}

// only is the one request received; the test fails otherwise.
func (s *httpSink) only(t *testing.T) *coltracepb.ExportTraceServiceRequest {
	t.Helper()
	got := s.received()
	if len(got) != 1 {
		t.Fatalf("the sink received %d export requests, want 1", len(got))
	}
	return got[0]
}
