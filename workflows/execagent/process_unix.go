//go:build unix

package execagent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/osmo-rl/osmo/internal/procgroup"
)

// runProcess runs spec's program in a process group of its own and returns
// once the program exited, its group was killed and its output drained.
//
// The runner owns the pipes rather than letting os/exec copy them: Wait then
// returns as soon as the leader exits, before any output reaches EOF, so the
// group can be killed first. A grandchild still holding stdout would
// otherwise keep Wait from returning.
func runProcess(ctx context.Context, spec procSpec) (*procResult, error) {
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("stdout pipe: %w", err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, fmt.Errorf("stderr pipe: %w", err)
	}
	// stdin is a pipe of our own, not StdinPipe's: a start that falls back
	// (see jail.start) builds the command twice.
	inR, stdin, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		errR.Close()
		errW.Close()
		return nil, fmt.Errorf("stdin pipe: %w", err)
	}
	newCmd := func() *exec.Cmd {
		return &exec.Cmd{
			Path:        spec.path,
			Args:        spec.argv,
			Dir:         spec.dir,
			Env:         spec.env,
			Stdin:       inR,
			Stdout:      outW,
			Stderr:      errW,
			SysProcAttr: procgroup.SysProcAttr(),
		}
	}
	cmd, startErr := spec.jail.start(newCmd)
	// The child has its copies; the write ends must close here so the
	// readers see EOF when the group is gone.
	outW.Close()
	errW.Close()
	inR.Close()
	if startErr != nil {
		outR.Close()
		errR.Close()
		stdin.Close()
		return nil, fmt.Errorf("start: %w", startErr)
	}
	pid := cmd.Process.Pid
	spec.logger.Debug("exec agent started", "pid", pid, "argv", spec.argv, "dir", spec.dir)

	res := &procResult{pid: pid, stdout: &lastLine{max: spec.maxLine}}
	stderr := &stderrLines{emit: spec.onStderr, lineMax: stderrLogLineBytes, tailMax: spec.tailBytes}
	var readers, writer sync.WaitGroup
	readers.Go(func() {
		// The writers take every write: a copy ends when the pipe does.
		_, _ = io.Copy(res.stdout, outR)
		res.stdout.finish()
	})
	readers.Go(func() {
		_, _ = io.Copy(stderr, errR)
		stderr.finish()
	})
	writer.Go(func() {
		_, werr := stdin.Write(spec.stdin)
		cerr := stdin.Close()
		if err := errors.Join(werr, cerr); err != nil && !errors.Is(err, syscall.EPIPE) && !errors.Is(err, os.ErrClosed) {
			spec.logger.Debug("exec agent: writing stdin failed", "error", err)
		}
	})

	g := procgroup.New(pid)
	exited := make(chan struct{})
	var watcher sync.WaitGroup
	watcher.Go(func() { watch(ctx, g, exited, spec.grace, spec.logger) })
	watcher.Go(func() { spec.jail.watch(exited, func() { g.Signal(syscall.SIGKILL) }) })
	waitErr := procgroup.WaitLeader(cmd, func() {
		g.Reap()
		close(exited)
	})
	// Once the leader is gone, so is the group: Wait closed nothing of
	// ours, so a program that never read its stdin is freed here.
	stdin.Close()
	watcher.Wait()
	// Whatever left the process group (setsid) but not the cgroup.
	spec.jail.killAll()

	// The group is dead; only a process that left it (setsid) can still
	// hold the pipes. Give it the grace period, then stop reading.
	drained := make(chan struct{})
	go func() {
		readers.Wait()
		close(drained)
	}()
	select {
	case <-drained:
	case <-time.After(spec.grace):
		spec.logger.Warn("exec agent: output still open after its process group was killed; a process outside the group holds it; closing", "pid", pid)
		outR.Close()
		errR.Close()
		<-drained
	}
	outR.Close()
	errR.Close()
	writer.Wait()

	res.stderrTail = stderr.Tail()
	res.terminated, res.killed = g.Signalled()
	st := cmd.ProcessState
	if st == nil {
		return nil, fmt.Errorf("wait: %w", waitErr)
	}
	res.limit = spec.jail.check()
	res.cpu = st.UserTime() + st.SystemTime()
	res.exitCode = st.ExitCode()
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		res.signal = cmp.Or(unix.SignalName(ws.Signal()), ws.Signal().String())
	}
	return res, nil
}

// watch sends SIGTERM to the group when ctx ends, and SIGKILL if the leader
// has not exited grace later.
func watch(ctx context.Context, g *procgroup.Group, exited <-chan struct{}, grace time.Duration, log *slog.Logger) {
	select {
	case <-exited:
		return
	case <-ctx.Done():
	}
	if !g.Signal(syscall.SIGTERM) {
		return
	}
	log.Info("exec agent: context ended, process group sent SIGTERM", "pgid", g.ID(), "cause", ctx.Err())
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-exited:
	case <-t.C:
		if g.Signal(syscall.SIGKILL) {
			log.Info("exec agent: process group still running after the grace period, sent SIGKILL", "pgid", g.ID(), "grace", grace)
		}
	}
}

// reachable reports whether u may search every directory from dir up to
// the root, by the owner, group or other bits that apply to it (it runs
// with no supplementary groups).
func reachable(dir string, u *RunAs) error {
	if u.UID == 0 {
		return nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	for d := abs; ; d = filepath.Dir(d) {
		var st unix.Stat_t
		if err := unix.Stat(d, &st); err != nil {
			return fmt.Errorf("stat %s: %w", d, err)
		}
		bit := uint32(0o001)
		switch {
		case st.Uid == u.UID:
			bit = 0o100
		case st.Gid == u.GID:
			bit = 0o010
		}
		if mode := uint32(st.Mode); mode&bit == 0 {
			return fmt.Errorf("it may not enter %s (mode %#o, owner %d:%d)", d, mode&0o7777, st.Uid, st.Gid)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// processGone reports whether no process has this pid.
func processGone(pid int) bool {
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}
