package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/internal/tlsconfig/tlstest"
)

func TestLoopbackAddr(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:9000": true,
		"127.8.9.10:1":   true,
		"[::1]:9000":     true,
		"localhost:9000": true,
		"LOCALHOST:0":    true,
		":9000":          false, // every interface
		"0.0.0.0:9000":   false,
		"[::]:9000":      false,
		"10.0.0.1:9000":  false,
		"192.0.2.1:80":   false,
		// A name that does not resolve is not known to be loopback.
		"no-such-host.invalid:9000": false,
	} {
		if got := loopbackAddr(t.Context(), addr); got != want {
			t.Errorf("loopbackAddr(%q) = %v, want %v", addr, got, want)
		}
	}
}

// runCommand runs `osmo args...` in process with environment vars until
// it returns or ctx ends.
func runCommand(ctx context.Context, vars map[string]string, args ...string) (*logtest.Buffer, error) {
	var out logtest.Buffer
	e := &env{stdout: &out, stderr: &out, getenv: func(k string) string { return vars[k] }, reg: newRegistry(nil)}
	cmd, ok := commands()[args[0]]
	if !ok {
		return &out, errors.New("no command " + args[0])
	}
	return &out, cmd.run(ctx, e, args[1:])
}

// Every serving command refuses, before it listens on anything, to serve
// beyond loopback with nothing authenticating its callers, and says what
// to pass.
func TestOpenListenRefused(t *testing.T) {
	cases := map[string][]string{
		"serve":   {"serve", "-H", "0.0.0.0", "-p", "0"},
		"rollout": {"rollout", "--grpc-addr", ":0", "--metrics-addr", "", "--grader", "none"},
		"grader":  {"grader", "--grpc-addr", "0.0.0.0:0", "--metrics-addr", ""},
		"gateway": {"gateway", "--addr", ":0", "--rollout-addr", "127.0.0.1:1"},
		// The loopback HTTP port does not make the native gRPC one safe.
		"serve grpc": {"serve", "-H", "127.0.0.1", "-p", "0", "--grpc-addr", "0.0.0.0:0"},
	}
	for name, args := range cases {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			out, err := runCommand(ctx, nil, args...)
			if ctx.Err() != nil {
				t.Fatalf("%v: still running when its deadline passed: it served open; output:\n%s", args, out)
			}
			var ue usageError
			if !errors.As(err, &ue) {
				t.Fatalf("%v: err %v, want a usage error", args, err)
			}
			for _, want := range []string{"--api-key", "--insecure", "127.0.0.1", "no --api-key is set"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%v: error %q does not mention %q", args, err, want)
				}
			}
		})
	}
}

// serveUntilHealthy runs `osmo serve` on every interface, on a port of the
// kernel's choosing, with args until /health answers on loopback, then stops
// it, and returns what it logged.
func serveUntilHealthy(t *testing.T, vars map[string]string, check func(base string), args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	addrFile := filepath.Join(t.TempDir(), "addr.json")
	done := make(chan error, 1)
	var out *logtest.Buffer
	started := make(chan struct{})
	go func() {
		var err error
		out, err = runCommand(ctx, vars, append([]string{"serve", "-H", "0.0.0.0", "-p", "0", "--addr-file", addrFile, "--log-level", "warn"}, args...)...)
		close(started)
		done <- err
	}()
	base := ""
	for {
		if base == "" {
			base = loopbackURL(addrFile)
		}
		resp, err := http.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case err := <-done:
			t.Fatalf("serve %v returned before it was healthy: %v", args, err)
		case <-ctx.Done():
			t.Fatalf("serve %v: not healthy in time", args)
		case <-time.After(50 * time.Millisecond):
		}
	}
	check(base)
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("serve %v: %v", args, err)
	}
	<-started
	return out.String()
}

// loopbackURL is the loopback URL of the HTTP port addrFile reports, or ""
// while it reports none.
func loopbackURL(addrFile string) string {
	b, err := os.ReadFile(addrFile)
	if err != nil {
		return ""
	}
	var addrs map[string]string
	if json.Unmarshal(b, &addrs) != nil {
		return ""
	}
	u, err := url.Parse(addrs["http"])
	if err != nil {
		return ""
	}
	return "http://127.0.0.1:" + u.Port()
}

func status(t *testing.T, url, key string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// --insecure serves open on purpose, and says so at every start.
func TestInsecureServesWithWarning(t *testing.T) {
	out := serveUntilHealthy(t, nil, func(base string) {
		if got := status(t, base+"/metrics", ""); got != http.StatusOK {
			t.Errorf("GET /metrics with no key set: %d, want 200", got)
		}
	}, "--insecure")
	if !strings.Contains(out, `"level":"WARN"`) || !strings.Contains(out, "WITHOUT authentication") {
		t.Errorf("serve --insecure logged no warning:\n%s", out)
	}
}

// With a key the port is open to the network, and everything on it but
// /health needs the key, /metrics included.
func TestKeyedServeGuardsMetrics(t *testing.T) {
	const key = "k-3f9a1c"
	out := serveUntilHealthy(t, map[string]string{"OSMO_API_KEY": key}, func(base string) {
		for _, c := range []struct {
			path, key string
			want      int
		}{
			{"/health", "", http.StatusOK},
			{"/metrics", "", http.StatusUnauthorized},
			{"/metrics", "wrong", http.StatusUnauthorized},
			{"/metrics", key, http.StatusOK},
			{"/v1/rollouts/x", "", http.StatusUnauthorized},
		} {
			if got := status(t, base+c.path, c.key); got != c.want {
				t.Errorf("GET %s (key %q): %d, want %d", c.path, c.key, got, c.want)
			}
		}
	})
	if strings.Contains(out, key) {
		t.Errorf("serve logged its API key:\n%s", out)
	}
	if strings.Contains(out, "WITHOUT authentication") {
		t.Errorf("a keyed serve warned it was open:\n%s", out)
	}
}

// Usage text never shows a secret read from the environment: -h and every
// flag error print it.
func TestUsageHidesSecrets(t *testing.T) {
	const secret = "s3cr3t-from-env"
	vars := map[string]string{"OSMO_API_KEY": secret, "OSMO_UPSTREAM_API_KEY": secret}
	for sub, cmd := range commands() {
		for _, args := range [][]string{{"-h"}, {"--no-such-flag"}} {
			var out bytes.Buffer
			e := &env{stdout: &out, stderr: &out, getenv: func(k string) string { return vars[k] }, reg: newRegistry(nil),
				flagSets: func(*flag.FlagSet) {}}
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			_ = cmd.run(ctx, e, args)
			cancel()
			if strings.Contains(out.String(), secret) {
				t.Errorf("osmo %s %v printed the key from the environment:\n%s", sub, args, out.String())
			}
		}
	}
}

// Mutual TLS authenticates callers as a key does: a grader that requires
// client certificates may listen beyond loopback without a key; one that
// only serves TLS may not.
func TestMutualTLSCountsAsAuthentication(t *testing.T) {
	ca := tlstest.NewCA(t, "ca")
	files := ca.Issue(t, "osmo", "localhost").Write(t, t.TempDir(), "osmo", ca)
	base := []string{"grader", "--grpc-addr", "0.0.0.0:0", "--metrics-addr", "", "--log-level", "error",
		"--tls-cert", files.Cert, "--tls-key", files.Key}

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err := runCommand(ctx, nil, base...)
	if !strings.Contains(fmt.Sprint(err), "no --api-key is set") {
		t.Errorf("TLS without client certificates: %v, want the refusal", err)
	}

	ctx, cancel = context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	out, err := runCommand(ctx, nil, append(base, "--tls-ca", files.CA)...)
	if ctx.Err() == nil {
		t.Fatalf("mutual TLS: returned %v before its deadline, want it serving; output:\n%s", err, out)
	}
}
