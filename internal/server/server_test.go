package server

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"
)

// ServeHTTP must not return while a handler runs: http.Server.Serve
// returns as soon as Shutdown begins, and callers read what handlers
// record once it has returned.
func TestServeHTTPWaitsForHandlers(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	finished := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		close(finished)
	}), ReadHeaderTimeout: time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- ServeHTTP(ctx, srv, ln, 10*time.Second) }()
	go func() {
		if resp, err := http.Get("http://" + ln.Addr().String()); err == nil {
			resp.Body.Close()
		}
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the request never reached the handler")
	}
	cancel()
	select {
	case err := <-served:
		t.Fatalf("ServeHTTP returned (%v) while a handler was running", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("ServeHTTP: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ServeHTTP did not return once the handler had")
	}
	select {
	case <-finished:
	default:
		t.Fatal("ServeHTTP returned before the handler finished")
	}
}

// A handler that outlasts the grace has its connection cut, and ServeHTTP
// returns within about the grace.
func TestServeHTTPBoundsTheGrace(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
	}), ReadHeaderTimeout: time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- ServeHTTP(ctx, srv, ln, 100*time.Millisecond) }()
	go func() {
		if resp, err := http.Get("http://" + ln.Addr().String()); err == nil {
			resp.Body.Close()
		}
	}()
	<-entered
	cancel()
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("ServeHTTP waited past its grace")
	}
}
