package controller_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// startPolicy serves policy (a mockllm one when nil) until the test ends
// and returns its OpenAI base URL.
func startPolicy(t *testing.T, policy http.Handler) string {
	t.Helper()
	if policy == nil {
		m, err := mockllm.New(mockllm.Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		policy = m
	}
	ps := httptest.NewServer(policy)
	t.Cleanup(ps.Close)
	return ps.URL + "/v1"
}

// serve runs c until the test ends, then checks it stopped cleanly.
func serve(t *testing.T, c interface{ Serve(context.Context) error }) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("controller did not stop in 10s")
		}
	})
}
