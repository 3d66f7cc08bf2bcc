//go:build unix

// Package proctest runs programs as real processes for tests: each in its
// own process group, with its output kept for assertions, stopped (SIGTERM,
// then SIGKILL) by the test's cleanup.
package proctest

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Cmd describes a process to start.
type Cmd struct {
	// Name labels the process in logs.
	Name string
	Bin  string
	Args []string
	// Env is the whole environment of the process.
	Env []string
	// Grace is how long cleanup waits after SIGTERM before SIGKILL.
	Grace time.Duration
}

// Proc is a running process.
type Proc struct {
	Name string
	cmd  *exec.Cmd
	done chan struct{}

	mu  sync.Mutex
	out bytes.Buffer
}

// Start runs c; the test's cleanup stops it and, if the test failed, logs
// its output.
func Start(t testing.TB, c Cmd) *Proc {
	t.Helper()
	p := &Proc{Name: c.Name, done: make(chan struct{})}
	p.cmd = exec.Command(c.Bin, c.Args...)
	p.cmd.Env = withTempDir(t, c.Env)
	p.cmd.Stdout, p.cmd.Stderr = p, p
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", c.Name, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.Stop(syscall.SIGTERM, c.Grace)
		if t.Failed() {
			t.Logf("--- %s %q ---\n%s", c.Name, c.Args, p.Output())
		}
	})
	return p
}

// withTempDir is env (the test's own when nil) with a TMPDIR of the
// test's, unless env sets one: what a process leaves there (an embedded
// NATS server's directory, say, when the test kills it) goes with the test.
func withTempDir(t testing.TB, env []string) []string {
	if env == nil {
		env = os.Environ()
	}
	for _, kv := range env {
		if strings.HasPrefix(kv, "TMPDIR=") {
			return env
		}
	}
	return append(env[:len(env):len(env)], "TMPDIR="+t.TempDir())
}

// Write collects the process's stdout and stderr.
func (p *Proc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

// Output is everything the process wrote so far.
func (p *Proc) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// ExitCode waits for the process to exit and returns its exit status (-1
// when a signal ended it).
func (p *Proc) ExitCode() int {
	<-p.done
	return p.cmd.ProcessState.ExitCode()
}

// Stop signals the process group and waits up to grace, then kills it.
func (p *Proc) Stop(sig syscall.Signal, grace time.Duration) {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, sig)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// Addrs waits until the process has written the JSON object of its
// listening addresses to path (osmo's --addr-file, given with port 0) and
// returns it. The test fails if the process exits first or takes longer
// than a minute.
func (p *Proc) Addrs(t testing.TB, path string) map[string]string {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		if b, err := os.ReadFile(path); err == nil {
			var addrs map[string]string
			if err := json.Unmarshal(b, &addrs); err != nil {
				t.Fatalf("%s: %s: %v", p.Name, path, err)
			}
			return addrs
		}
		if p.Exited() {
			t.Fatalf("%s exited before it listened:\n%s", p.Name, p.Output())
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no %s after a minute:\n%s", p.Name, path, p.Output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// FreeAddr returns a loopback address with a port nothing listens on now
// and that no earlier call of this process returned. It is for programs
// that must be told their ports before they start (a NATS cluster's
// routes, Jaeger's endpoints); osmo's servers listen on port 0 and report
// their addresses instead (Proc.Addrs).
//
// The port is drawn below the kernel's ephemeral range, where it stays
// free until the process under test binds it: a port from the ephemeral
// range (what listening on port 0 gives) can meanwhile become the source
// port of any outgoing loopback connection on the machine, and the bind
// then fails with "address already in use". Where the range leaves no
// room below it, the kernel's own choice is the fallback.
func FreeAddr(t testing.TB) string {
	t.Helper()
	lo := ephemeralLow()
	for range 200 {
		port := 0
		if lo > freePortFloor+1000 {
			port = freePortFloor + rand.IntN(lo-freePortFloor)
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			if port == 0 {
				t.Fatal(err)
			}
			continue // taken: draw again
		}
		addr := ln.Addr().String()
		_ = ln.Close()
		if _, taken := handedOut.LoadOrStore(addr, true); !taken {
			return addr
		}
	}
	t.Fatal("proctest: no loopback port that was free and not handed out already")
	return ""
}

// freePortFloor is the lowest port FreeAddr draws: above the well-known
// and most registered services' ports.
const freePortFloor = 20000

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's
// ip_local_port_range; 32768, its default, where it cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return lo
}

// handedOut holds every address FreeAddr returned in this test process.
var handedOut sync.Map
