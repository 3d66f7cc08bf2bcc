package cli

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

// startMock runs `osmo mockllm args...` in process and returns its loopback
// URL once healthy, and the channel its result comes on.
func startMock(t *testing.T, ctx context.Context, args ...string) (string, <-chan error) {
	t.Helper()
	addrFile := filepath.Join(t.TempDir(), "addr.json")
	done := make(chan error, 1)
	go func() {
		_, err := runCommand(ctx, nil, append([]string{"mockllm", "--addr", "127.0.0.1:0", "--addr-file", addrFile, "--log-level", "error"}, args...)...)
		done <- err
	}()
	for {
		if base := loopbackURL(addrFile); base != "" && healthy(base) {
			return base, done
		}
		select {
		case err := <-done:
			t.Fatalf("mockllm %v returned before it was healthy: %v", args, err)
		case <-ctx.Done():
			t.Fatalf("mockllm %v: not healthy in time", args)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func healthy(base string) bool {
	resp, err := http.Get(base + "/health")
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func mockChat(base string) (*http.Response, error) {
	resp, err := http.Post(base+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"messages":[{"role":"user","content":"What is 6 times 7?"}]}`))
	if err == nil {
		_ = resp.Body.Close()
	}
	return resp, err
}

// TestMockEngineDiesAndComesBack: --die-after cuts the request that kills
// the engine, closes its port, and --down-for brings a fresh engine back
// on the same port.
func TestMockEngineDiesAndComesBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	base, done := startMock(t, ctx, "--engine-id", "e1", "--die-after", "2", "--down-for", "300ms")
	resp, err := mockChat(base)
	if err != nil || resp.StatusCode != http.StatusOK || resp.Header.Get(mockllm.EngineHeader) != "e1" {
		t.Fatalf("first request: %v %v", resp, err)
	}
	if resp, err := mockChat(base); err == nil {
		t.Fatalf("the request the engine dies at was answered %d", resp.StatusCode)
	}
	down := false
	for !down && ctx.Err() == nil {
		down = !healthy(base)
	}
	for ctx.Err() == nil && !healthy(base) {
		time.Sleep(10 * time.Millisecond)
	}
	if !down || ctx.Err() != nil {
		t.Fatalf("the engine did not go down (%v) and come back (%v)", down, ctx.Err())
	}
	for i := range 3 {
		if resp, err := mockChat(base); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d after coming back: %v %v", i, resp, err)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("mockllm stopped with %v", err)
	}
}

func TestMockEngineDies(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	base, done := startMock(t, ctx, "--engine-id", "e2", "--die-after", "1")
	if resp, err := mockChat(base); err == nil {
		t.Fatalf("the request the engine dies at was answered %d", resp.StatusCode)
	}
	if err := <-done; err == nil || !strings.Contains(err.Error(), "died") {
		t.Errorf("a dead engine's command returned %v, want an error saying it died", err)
	}
}

func TestMockEngineFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--down-for", "1s"},
		{"--die-after", "1", "--down-for", "-1s"},
		{"--fail-mode", "500", "--fail-fraction", "1.5"},
		{"--fail-fraction", "0.5"},
		{"--die-after", "-1"},
	} {
		_, err := runCommand(t.Context(), nil, append([]string{"mockllm", "--addr", "127.0.0.1:0"}, args...)...)
		if !errors.As(err, new(usageError)) {
			t.Errorf("mockllm %v: %v, want a usage error", args, err)
		}
	}
}
