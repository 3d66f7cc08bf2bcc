//go:build unix

// Package proctest runs programs as real processes for tests: each in its
// own process group, with its output kept for assertions, stopped (SIGTERM,
// then SIGKILL) by the test's cleanup.
package proctest

import (
	"bytes"
	"net"
	"os/exec"
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
	p.cmd.Env = c.Env
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

// FreeAddr returns a loopback address with a port nothing listens on now
// and that no earlier call of this process returned: the kernel may hand
// a port closed a moment ago to the next listener, so two addresses taken
// before either process binds its own could otherwise be the same.
func FreeAddr(t testing.TB) string {
	t.Helper()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		_ = ln.Close()
		if _, taken := handedOut.LoadOrStore(addr, true); !taken {
			return addr
		}
	}
	t.Fatal("proctest: no loopback port that was not handed out already")
	return ""
}

// handedOut holds every address FreeAddr returned in this test process.
var handedOut sync.Map
