// Package e2e runs the osmo binary as real processes on loopback and drives
// them as a trainer would.
package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/osmo-rl/osmo/internal/proctest"
)

// osmoBin is the binary under test, built once in TestMain.
var osmoBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "osmo-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	osmoBin = filepath.Join(dir, "osmo")
	build := exec.Command("go", "build", "-o", osmoBin, "../cmd/osmo")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building osmo:", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// freeAddr returns a loopback address with a port nothing listens on now,
// for the programs that must know their ports before they start (NATS
// routes, Jaeger); osmo's own servers use startListening.
func freeAddr(t *testing.T) string { return proctest.FreeAddr(t) }

// startMockPolicy runs `osmo mockllm` with args on a loopback port of the
// kernel's choosing until the test ends, and returns its address once it
// answers.
func startMockPolicy(t *testing.T, args ...string) string {
	t.Helper()
	mock, addrs := startListening(t, "mockllm", nil, append([]string{"mockllm", "--addr", "127.0.0.1:0", "--log-level", "warn"}, args...)...)
	waitHTTP(t, mock, addrs["http"]+"/health")
	return strings.TrimPrefix(addrs["http"], "http://")
}

// refusedAddr is an address nothing listens on: port 1 is privileged, and
// no service of a test machine uses it.
const refusedAddr = "127.0.0.1:1"

// samePort is args with the value of its -p flag set to the port of url:
// a restarted server listens where the first one was reported to.
func samePort(t *testing.T, args []string, url string) []string {
	t.Helper()
	i := slices.Index(args, "-p")
	_, port, err := net.SplitHostPort(strings.TrimPrefix(strings.TrimPrefix(url, "http://"), "https://"))
	if i < 0 || i+1 >= len(args) || err != nil {
		t.Fatalf("no -p in %q, or no port in %q: %v", args, url, err)
	}
	out := slices.Clone(args)
	out[i+1] = port
	return out
}

// startListening is start for a server osmo command whose args bind port
// 0: it returns the process and the addresses it reports (--addr-file).
func startListening(t *testing.T, name string, env []string, args ...string) (*proc, map[string]string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "addr.json")
	p := start(t, name, env, append(args, "--addr-file", path)...)
	return p, p.Addrs(t, path)
}

// proc is a running process whose output is kept for assertions.
type proc = proctest.Proc

// start runs osmo with args in its own process group; the test's cleanup
// stops it (SIGTERM, then SIGKILL) and waits for it.
func start(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	return startBin(t, name, osmoBin, env, args...)
}

// startBin is start for any binary.
func startBin(t *testing.T, name, bin string, env []string, args ...string) *proc {
	t.Helper()
	return proctest.Start(t, proctest.Cmd{Name: name, Bin: bin, Args: args, Env: append(os.Environ(), env...), Grace: 20 * time.Second})
}

// waitHTTP polls url until it answers 200.
func waitHTTP(t *testing.T, p *proc, url string) {
	t.Helper()
	waitHTTPClient(t, p, http.DefaultClient, url)
}

// waitHTTPClient is waitHTTP with client (an https one, say).
func waitHTTPClient(t *testing.T, p *proc, client *http.Client, url string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.Done():
			t.Fatalf("%s exited early:\n%s", p.Name, p.Output())
		default:
		}
		resp, err := client.Get(url)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s not healthy at %s:\n%s", p.Name, url, p.Output())
}

// waitGRPC polls a gRPC health endpoint until SERVING.
func waitGRPC(t *testing.T, p *proc, addr string) {
	t.Helper()
	waitGRPCWithin(t, p, addr, 20*time.Second)
}

// waitGRPCWithin is waitGRPC with a deadline of its own: a replica that
// starts while a NATS node restarts waits for the cluster to settle.
func waitGRPCWithin(t *testing.T, p *proc, addr string, d time.Duration) {
	t.Helper()
	waitGRPCCreds(t, p, addr, d, insecure.NewCredentials())
}

// waitGRPCCreds is waitGRPCWithin over creds (TLS ones, say).
func waitGRPCCreds(t *testing.T, p *proc, addr string, d time.Duration, creds credentials.TransportCredentials) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		select {
		case <-p.Done():
			t.Fatalf("%s exited early:\n%s", p.Name, p.Output())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s not serving at %s:\n%s", p.Name, addr, p.Output())
}

// httpGet returns the body of a 200 answer to GET url.
func httpGet(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	return string(b)
}

// countLines counts output lines containing every one of subs.
func countLines(out string, subs ...string) int {
	n := 0
	for _, line := range strings.Split(out, "\n") {
		ok := true
		for _, s := range subs {
			if !strings.Contains(line, s) {
				ok = false
				break
			}
		}
		if ok {
			n++
		}
	}
	return n
}
