// Package server runs gRPC and HTTP servers the same way everywhere: the
// listener opens in the constructor (so tests can use port 0 and read the
// address), and Serve blocks until its context ends, then shuts down
// gracefully within a bound.
package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/test/bufconn"
)

// ShutdownTimeout bounds graceful shutdown before connections are cut.
const ShutdownTimeout = 15 * time.Second

// GRPC is a grpc.Server bound to a listener, and to an in-memory one for
// clients in the same process (LocalDialer).
type GRPC struct {
	*grpc.Server
	ln    net.Listener
	local *bufconn.Listener
}

// localBuffer is the in-memory connection's buffer: larger than a gRPC
// flow-control window, so a window's worth never waits for the reader.
const localBuffer = 1 << 20

// NewGRPC listens on addr and returns a server built with opts; register
// services on the embedded *grpc.Server before Serve.
func NewGRPC(addr string, opts ...grpc.ServerOption) (*GRPC, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("server.NewGRPC: %w", err)
	}
	return &GRPC{Server: grpc.NewServer(opts...), ln: ln, local: bufconn.Listen(localBuffer)}, nil
}

// LocalDialer makes a client connect to the server in memory: a caller in
// the same process reaches the same services, interceptors and stats
// handlers as over the network, without a socket.
func (s *GRPC) LocalDialer() grpc.DialOption {
	return grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
		return s.local.DialContext(ctx)
	})
}

// Addr is the bound address (useful with port 0).
func (s *GRPC) Addr() string { return s.ln.Addr().String() }

// Close releases the listener of a server that will not Serve (a startup
// that failed half way).
func (s *GRPC) Close() error { return errors.Join(s.ln.Close(), s.local.Close()) }

// Serve serves until ctx ends, then stops gracefully (hard after ShutdownTimeout).
func (s *GRPC) Serve(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() { errc <- s.Server.Serve(s.ln) }()
	// The network listener's Serve reports the stop.
	go func() { _ = s.Server.Serve(s.local) }()
	select {
	case err := <-errc:
		return fmt.Errorf("grpc serve: %w", err)
	case <-ctx.Done():
	}
	done := make(chan struct{})
	go func() { s.GracefulStop(); close(done) }()
	t := time.NewTimer(ShutdownTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		s.Stop()
	}
	return nil
}

// HTTP is an http.Server bound to a listener. It speaks HTTP/1.1 and
// cleartext HTTP/2 (h2c), so gRPC and Connect clients can use the same port;
// made by NewHTTPS, HTTP/1.1 and HTTP/2 over TLS instead, chosen by ALPN.
type HTTP struct {
	srv *http.Server
	ln  net.Listener
	tls bool
}

// NewHTTP listens on addr for h.
func NewHTTP(addr string, h http.Handler) (*HTTP, error) { return newHTTP(addr, h, nil) }

// NewHTTPS listens on addr for h and serves TLS with cfg. cfg must offer
// h2 and http/1.1 by ALPN (in NextProtos, or in those of the
// configurations its GetConfigForClient returns): gRPC clients need h2.
func NewHTTPS(addr string, h http.Handler, cfg *tls.Config) (*HTTP, error) {
	if cfg == nil {
		return nil, errors.New("server.NewHTTPS: no TLS configuration")
	}
	return newHTTP(addr, h, cfg)
}

func newHTTP(addr string, h http.Handler, cfg *tls.Config) (*HTTP, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("server.NewHTTP: %w", err)
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	if cfg != nil {
		protocols.SetHTTP2(true)
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	return &HTTP{
		srv: &http.Server{
			Handler:           h,
			Protocols:         &protocols,
			TLSConfig:         cfg,
			ReadHeaderTimeout: 10 * time.Second,
			MaxHeaderBytes:    1 << 20,
		},
		ln:  ln,
		tls: cfg != nil,
	}, nil
}

// Addr is the bound address.
func (s *HTTP) Addr() string { return s.ln.Addr().String() }

// Close releases the listener of a server that will not Serve.
func (s *HTTP) Close() error { return s.ln.Close() }

// URL is http://Addr, or https://Addr.
func (s *HTTP) URL() string {
	if s.tls {
		return "https://" + s.Addr()
	}
	return "http://" + s.Addr()
}

// Serve serves until ctx ends, then shuts down gracefully.
func (s *HTTP) Serve(ctx context.Context) error {
	serve := func() error { return s.srv.Serve(s.ln) }
	if s.tls {
		// The certificate comes from TLSConfig.
		serve = func() error { return s.srv.ServeTLS(s.ln, "", "") }
	}
	return serveUntil(ctx, s.srv, serve, ShutdownTimeout)
}

// ServeHTTP serves srv on ln until ctx ends, then shuts it down, waiting up
// to grace for requests in progress. Unlike http.Server.Serve it returns
// once handlers finished, so a caller may read what they record.
func ServeHTTP(ctx context.Context, srv *http.Server, ln net.Listener, grace time.Duration) error {
	return serveUntil(ctx, srv, func() error { return srv.Serve(ln) }, grace)
}

func serveUntil(ctx context.Context, srv *http.Server, serve func() error, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- serve() }()
	select {
	case err := <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return fmt.Errorf("http serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	<-errc
	return nil
}
