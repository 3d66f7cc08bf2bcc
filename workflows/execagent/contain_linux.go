package execagent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/osmo-rl/osmo/internal/cgroup"
)

// pollEvery is how often a run's cgroup counters are read: how long a
// program that hit its memory or process limit may go on before its run is
// ended.
const pollEvery = 100 * time.Millisecond

// host is what the machine offers to contain runs, found once per workflow.
type host struct {
	cgroups *cgroup.Manager // nil: none usable
	why     error           // why not
	logged  sync.Once
	// cloneRefused: starting a program inside its cgroup failed once, so
	// programs join it after they start.
	cloneRefused atomic.Bool
	scratch      scratchDirs
}

// logOnce says, at the first run, what contains the runs: the operator
// reads there what protects the server.
func (h *host) logOnce(log *slog.Logger, asked Limits) {
	h.logged.Do(func() { log.Info("exec agents contained", h.enforcement(asked)...) })
}

func detectHost() *host {
	m, err := cgroup.Detect()
	return &host{cgroups: m, why: err}
}

// enforcement says how each limit of asked is enforced on this host.
func (h *host) enforcement(asked Limits) []any {
	lim := asked.effective()
	memCG, procCG := false, false
	where := "no cgroups (" + fmt.Sprint(h.why) + ")"
	start := "stopped at its exec (ptrace) until contained"
	if h.cgroups != nil {
		memCG, procCG = h.cgroups.Enforces()
		where = h.cgroups.String()
		if h.cgroups.V2() {
			start = "created inside its cgroup (clone3)"
		}
	}
	nonRoot := os.Geteuid() != 0 || lim.User != nil && lim.User.UID != 0
	mem := "not enforced"
	switch {
	case lim.Memory == Unlimited:
		mem = "off"
	case memCG:
		mem = "cgroup"
	case asked.Memory > 0:
		mem = "RLIMIT_AS (virtual memory, per process)"
	}
	procs := "not enforced"
	switch {
	case lim.Processes == Unlimited:
		procs = "off"
	case procCG:
		procs = "cgroup"
	case nonRoot:
		procs = "RLIMIT_NPROC (counts every process of the user)"
	}
	user := "osmo's"
	if lim.User != nil {
		user = fmt.Sprintf("%d:%d", lim.User.UID, lim.User.GID)
	}
	return []any{"limits", lim.String(), "where", where, "start", start, "memory", mem, "processes", procs,
		"files_cpu_file_size", "rlimits per process", "user", user}
}

// jail is one run's containment: its scratch directory (its working
// directory and TMPDIR), its cgroup and the limit it hit, if any.
type jail struct {
	lim, asked Limits
	host       *host
	log        *slog.Logger
	scratch    string
	group      *cgroup.Group

	mu     sync.Mutex
	breach *LimitError
}

func (h *host) newJail(asked Limits, scratchBase string, log *slog.Logger) (*jail, error) {
	j := &jail{lim: asked.effective(), asked: asked, host: h, log: log}
	var err error
	if j.scratch, err = h.scratch.make(scratchBase, j.lim.User, log); err != nil {
		return nil, err
	}
	if h.cgroups != nil {
		// Unlimited (-1) is no limit, as zero is there.
		cl := cgroup.Limits{Memory: max(j.lim.Memory, 0), Processes: int(max(j.lim.Processes, 0))}
		if j.group, err = h.cgroups.New(filepath.Base(j.scratch), cl); err != nil {
			_ = removeAll(j.scratch)
			return nil, err
		}
	}
	return j, nil
}

// start starts the program newCmd builds, contained from its first
// instruction. On cgroup v2 the kernel creates it inside the run's group
// (clone3's CLONE_INTO_CGROUP), which bounds its memory and processes and
// holds all it forks; its rlimits and oom_score_adj are set just after it
// started (a process it forks in that moment keeps the server's, inside the
// group still). v1 has no such start, and without cgroups the rlimits are
// all that bound a run, so there the child stops at its exec (ptrace) until
// its cgroup, rlimits and oom_score_adj are in place. Where ptrace is
// refused too (a seccomp profile), that is done just after it starts: a
// program that forks within that moment leaves children outside the
// cgroup, in its process group still.
func (j *jail) start(newCmd func() *exec.Cmd) (*exec.Cmd, error) {
	if j.group != nil && j.group.FD() >= 0 && !j.host.cloneRefused.Load() {
		cmd := newCmd()
		j.prepare(cmd, false)
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, j.group.FD()
		err := cmd.Start()
		if err == nil {
			return j.started(cmd, j.setup(cmd.Process.Pid, false))
		}
		if !errors.Is(err, syscall.ENOSYS) && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.EPERM) {
			return nil, err
		}
		// No clone3 (a seccomp profile such as Docker's default answers
		// ENOSYS, so that libc falls back to clone; Linux before 5.7 has
		// no CLONE_INTO_CGROUP): contain it as on v1.
		if !j.host.cloneRefused.Swap(true) {
			j.log.Warn("exec agent: clone3 into the cgroup refused; stopping programs at their exec until they are contained", "error", err)
		}
	}
	cmd := newCmd()
	j.prepare(cmd, true)
	// The tracer is the thread that forked; only it may detach.
	runtime.LockOSThread()
	err := cmd.Start()
	if err == nil {
		err = j.setupStopped(cmd.Process.Pid)
		runtime.UnlockOSThread()
		return j.started(cmd, err)
	}
	runtime.UnlockOSThread()
	if !errors.Is(err, syscall.EPERM) {
		return nil, err
	}
	j.log.Warn("exec agent: ptrace refused; containing the program just after it starts", "error", err)
	cmd = newCmd()
	j.prepare(cmd, false)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return j.started(cmd, j.setup(cmd.Process.Pid, true))
}

// started returns cmd, or kills and reaps it when containing it failed.
func (j *jail) started(cmd *exec.Cmd, err error) (*exec.Cmd, error) {
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, err
	}
	return cmd, nil
}

func (j *jail) prepare(cmd *exec.Cmd, trace bool) {
	cmd.SysProcAttr.Ptrace = trace
	if u := j.lim.User; u != nil {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: []uint32{}}
	}
}

// setupStopped waits for the traced child's stop at exec, contains it and
// lets it go.
func (j *jail) setupStopped(pid int) error {
	var ws unix.WaitStatus
	_, err := unix.Wait4(pid, &ws, unix.WALL, nil)
	for errors.Is(err, unix.EINTR) {
		_, err = unix.Wait4(pid, &ws, unix.WALL, nil)
	}
	if err != nil {
		return fmt.Errorf("wait for the exec stop: %w", err)
	}
	if !ws.Stopped() {
		return fmt.Errorf("program ended before it ran (status %#x)", uint32(ws))
	}
	serr := j.setup(pid, true)
	if err := unix.PtraceDetach(pid); err != nil {
		return errors.Join(serr, fmt.Errorf("ptrace detach: %w", err))
	}
	return serr
}

// setup moves pid into the run's cgroup when join, and sets its rlimits and
// oom_score_adj.
func (j *jail) setup(pid int, join bool) error {
	if j.group != nil && join {
		if err := j.group.Add(pid); err != nil {
			return err
		}
	}
	memCG, procCG := false, false
	if j.host.cgroups != nil {
		memCG, procCG = j.host.cgroups.Enforces()
	}
	set := func(res int, name string, v int64) error {
		if v <= 0 {
			return nil
		}
		if err := unix.Prlimit(pid, res, &unix.Rlimit{Cur: uint64(v), Max: uint64(v)}, nil); err != nil {
			return fmt.Errorf("set %s to %d: %w", name, v, err)
		}
		return nil
	}
	var errs []error
	errs = append(errs, set(unix.RLIMIT_NOFILE, "RLIMIT_NOFILE", j.lim.Files))
	errs = append(errs, set(unix.RLIMIT_FSIZE, "RLIMIT_FSIZE", j.lim.FileSize))
	if j.lim.CPU > 0 {
		// SIGXCPU at the limit; SIGKILL a second later for a program that
		// ignores it.
		s := uint64(j.lim.CPU / time.Second)
		if err := unix.Prlimit(pid, unix.RLIMIT_CPU, &unix.Rlimit{Cur: s, Max: s + 1}, nil); err != nil {
			errs = append(errs, fmt.Errorf("set RLIMIT_CPU: %w", err))
		}
	}
	if !memCG && j.asked.Memory > 0 {
		// Virtual memory, not use: only when asked for, since runtimes
		// such as Node reserve far more address space than they touch.
		errs = append(errs, set(unix.RLIMIT_AS, "RLIMIT_AS", j.lim.Memory))
	}
	if !procCG && j.lim.Processes > 0 {
		// Ignored for root; counts every process of the user.
		errs = append(errs, set(unix.RLIMIT_NPROC, "RLIMIT_NPROC", j.lim.Processes))
	}
	if err := errors.Join(errs...); err != nil && j.lim.User != nil && errors.Is(err, syscall.EPERM) {
		// Setting another user's rlimits takes CAP_SYS_RESOURCE, which a
		// container's root may lack; the cgroup still holds the run.
		j.log.Warn("exec agent: rlimits not set on a program run as another user (osmo lacks CAP_SYS_RESOURCE)", "error", err)
		errs = nil
	}
	// The kernel's OOM killer picks the program before osmo.
	if err := os.WriteFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", []byte("1000"), 0); err != nil {
		errs = append(errs, fmt.Errorf("oom_score_adj: %w", err))
	}
	return errors.Join(errs...)
}

// check reads the cgroup's counters and records the first limit hit.
func (j *jail) check() *LimitError {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.breach != nil || j.group == nil {
		return j.breach
	}
	ev, err := j.group.Events()
	if err != nil {
		j.log.Debug("exec agent: reading cgroup events failed", "error", err)
	}
	switch {
	case ev.OOMKills > 0:
		j.breach = &LimitError{Limit: "memory", Value: j.lim.value("memory"),
			How: fmt.Sprintf("the kernel's OOM killer killed %d of its processes", ev.OOMKills)}
	case ev.ForkFailures > 0:
		j.breach = &LimitError{Limit: "processes", Value: j.lim.value("processes"),
			How: fmt.Sprintf("%d forks refused", ev.ForkFailures)}
	}
	return j.breach
}

// watch polls the counters until exited closes; at the first limit hit it
// calls kill, which ends the run.
func (j *jail) watch(exited <-chan struct{}, kill func()) {
	if j.group == nil {
		return
	}
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-exited:
			return
		case <-t.C:
		}
		if b := j.check(); b != nil {
			j.log.Warn("exec agent hit a limit; ending the run", "limit", b.Limit, "value", b.Value, "how", b.How)
			kill()
			j.killAll()
			return
		}
	}
}

// killAll kills every process left in the cgroup, those that left the
// process group too.
func (j *jail) killAll() {
	if j.group != nil && !j.group.Kill(2*time.Second) {
		j.log.Warn("exec agent: processes left in its cgroup after SIGKILL", "cgroup", j.group.Dirs())
	}
}

// close removes the cgroup and the scratch directory.
func (j *jail) close() {
	if j.group != nil {
		if err := j.group.Remove(); err != nil {
			j.log.Warn("exec agent: removing its cgroup failed", "error", err)
		}
	}
	if err := removeAll(j.scratch); err != nil {
		j.log.Warn("exec agent: removing its scratch directory failed", "dir", j.scratch, "error", err)
	}
}
