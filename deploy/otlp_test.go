package deploy_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	_ "google.golang.org/grpc/encoding/gzip" // exporters may compress
)

// otlpSink stands in for Jaeger's OTLP receivers on loopback: OTLP/gRPC on
// one port (Jaeger's 4317) and OTLP/HTTP on another (4318). It keeps every
// export's raw protobuf; service names are plain strings inside it, which is
// all the tests look for.
type otlpSink struct {
	GRPCAddr, HTTPAddr string

	mu      sync.Mutex
	exports [][]byte
	changed chan struct{}
}

// rawCodec hands gRPC message bytes through undecoded.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func startOTLPSink(t *testing.T) *otlpSink {
	t.Helper()
	s := &otlpSink{changed: make(chan struct{})}

	gln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// Any method on any service is an export: the sink answers every
	// Export (traces, metrics, logs) with an empty, successful response.
	gs := grpc.NewServer(
		grpc.ForceServerCodec(rawCodec{}),
		grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
			var req []byte
			if err := stream.RecvMsg(&req); err != nil {
				return err
			}
			s.add(req)
			empty := []byte{}
			return stream.SendMsg(&empty)
		}),
	)
	s.GRPCAddr = gln.Addr().String()
	go func() { _ = gs.Serve(gln) }()

	hln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/{signal}", func(w http.ResponseWriter, r *http.Request) {
		var body io.Reader = http.MaxBytesReader(w, r.Body, 32<<20)
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			defer zr.Close()
			body = zr
		}
		b, err := io.ReadAll(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.add(b)
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	})
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	s.HTTPAddr = hln.Addr().String()
	go func() { _ = hs.Serve(hln) }()

	t.Cleanup(func() {
		gs.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(ctx)
	})
	return s
}

func (s *otlpSink) add(b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.exports = append(s.exports, b)
	close(s.changed)
	s.changed = make(chan struct{})
}

// contains reports whether any export so far holds needle.
func (s *otlpSink) contains(needle string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.exports {
		if bytes.Contains(e, []byte(needle)) {
			return true
		}
	}
	return false
}

// waitFor blocks until an export holds every needle or ctx ends, and
// returns the needles still missing.
func (s *otlpSink) waitFor(ctx context.Context, needles ...string) ([]string, error) {
	for {
		s.mu.Lock()
		changed := s.changed
		s.mu.Unlock()
		var missing []string
		for _, n := range needles {
			if !s.contains(n) {
				missing = append(missing, n)
			}
		}
		if len(missing) == 0 {
			return nil, nil
		}
		select {
		case <-ctx.Done():
			return missing, ctx.Err()
		case <-changed:
		}
	}
}

// count is how many exports arrived.
func (s *otlpSink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.exports)
}
