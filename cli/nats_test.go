package cli_test

import (
	"context"
	"errors"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// osmo grader keeps its gradings in NATS: a --nats it cannot reach stops
// it at start, with a failing exit status and an error naming the URL.
func TestGraderExitsWhenNATSIsUnreachable(t *testing.T) {
	url := "nats://" + refusedAddr
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := withContext(ctx, osmoCommand(nil, "grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--nats", url))
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("osmo grader did not exit; it started serving:\n%s", out)
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() == 0 {
		t.Fatalf("osmo grader: %v, want a failing exit status\n%s", err, out)
	}
	if !strings.Contains(string(out), url) {
		t.Errorf("the error does not name %s:\n%s", url, out)
	}
	if strings.Contains(string(out), "grader service serving") {
		t.Errorf("osmo grader started serving:\n%s", out)
	}
}

// osmo serve opens the one store of its stack before it listens: an
// unreachable --nats stops it, names the URL and leaves no listener.
func TestServeFailsWhenNATSIsUnreachable(t *testing.T) {
	url := "nats://" + refusedAddr
	graderAddr := freeAddr(t)
	res := runCLI(t, []string{"serve", "-p", "0", "-H", "127.0.0.1", "--grader-addr", graderAddr, "--nats", url})
	if res.expired {
		t.Fatalf("serve returned only when its context ended: it started serving; err %v", res.err)
	}
	if res.err == nil || !strings.Contains(res.err.Error(), url) {
		t.Fatalf("serve: %v, want an error naming %s", res.err, url)
	}
	ln, err := net.Listen("tcp", graderAddr)
	if err != nil {
		t.Fatalf("the grader's address %s is still taken after serve gave up: %v", graderAddr, err)
	}
	_ = ln.Close()
}

// withContext makes cmd end with ctx (exec.CommandContext for a command
// already built).
func withContext(ctx context.Context, cmd *exec.Cmd) *exec.Cmd {
	c := exec.CommandContext(ctx, cmd.Path, cmd.Args[1:]...)
	c.Env = cmd.Env
	return c
}
