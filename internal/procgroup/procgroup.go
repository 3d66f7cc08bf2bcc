//go:build unix

// Package procgroup runs programs in process groups of their own and signals
// those groups safely: a group is signalled only while its leader is
// unreaped, so its id (the leader's pid) cannot have been reused by a
// stranger. Exec workflows and hosted rollout servers share it.
package procgroup

import (
	"os/exec"
	"sync"
	"syscall"
)

// SysProcAttr puts a started process in a new process group of its own
// and, where the system can, has the kernel kill it when osmo dies (a
// SIGKILLed osmo runs no cleanup, and an orphaned agent or rollout
// server would run on, holding its port and calling a model for no one).
func SysProcAttr() *syscall.SysProcAttr {
	a := &syscall.SysProcAttr{Setpgid: true}
	dieWithParent(a)
	return a
}

// Group is the process group led by a process started with SysProcAttr.
type Group struct {
	pgid int

	mu                 sync.Mutex
	reaped             bool
	terminated, killed bool
}

// New returns the group whose leader has pid.
func New(pid int) *Group { return &Group{pgid: pid} }

// ID is the group id (the leader's pid).
func (g *Group) ID() int { return g.pgid }

// Signal sends sig to the whole group unless the leader was reaped, and
// reports whether it was sent. SIGTERM and SIGKILL are remembered
// (Signalled).
func (g *Group) Signal(sig syscall.Signal) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.reaped {
		return false
	}
	switch sig {
	case syscall.SIGTERM:
		g.terminated = true
	case syscall.SIGKILL:
		g.killed = true
	}
	_ = syscall.Kill(-g.pgid, sig)
	return true
}

// Reap kills whatever is left of the group once the leader exited, and
// stops further signals: the leader is about to be reaped. Pass it to
// WaitLeader.
func (g *Group) Reap() {
	g.mu.Lock()
	defer g.mu.Unlock()
	// ESRCH (nothing left) is the usual answer.
	_ = syscall.Kill(-g.pgid, syscall.SIGKILL)
	g.reaped = true
}

// Signalled reports whether the group was sent SIGTERM and SIGKILL.
func (g *Group) Signalled() (terminated, killed bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.terminated, g.killed
}

// WaitLeader waits for cmd's process to exit, calls beforeReap while its
// pid is still held (on Linux: the zombie is not reaped yet), then reaps
// it and returns what cmd.Wait returns.
func WaitLeader(cmd *exec.Cmd, beforeReap func()) error { return waitLeader(cmd, beforeReap) }
