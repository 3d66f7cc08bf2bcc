package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// Manager creates groups under osmo's own group of one hierarchy.
type Manager struct {
	// base is the v2 directory groups are created in; "" on v1.
	base string
	// memBase and pidsBase are the v1 directories groups are created in,
	// per controller; "" when that controller is not mounted or not
	// writable.
	memBase, pidsBase string
}

// Detect finds where osmo may create groups: cgroup v2 when osmo's group
// there offers the memory and pids controllers, else cgroup v1's memory and
// pids hierarchies (either suffices). It creates and removes a probe group
// to be sure the hierarchy is writable. The error, wrapping ErrUnavailable,
// says why none is usable.
//
// On v2, enabling the controllers for child groups is refused while osmo's
// group holds processes (the "no internal processes" rule); Detect then
// moves them into a leaf group named osmo, as a container's init would.
func Detect() (*Manager, error) {
	self, err := procfs.Self()
	if err != nil {
		return nil, unavailable("%v", err)
	}
	groups, err := self.Cgroups()
	if err != nil {
		return nil, unavailable("%v", err)
	}
	ms, err := self.MountInfo()
	if err != nil {
		return nil, unavailable("%v", err)
	}
	paths := map[string]string{}
	for _, g := range groups {
		if g.HierarchyID == 0 && len(g.Controllers) == 0 {
			paths[""] = g.Path
		}
		for _, c := range g.Controllers {
			paths[c] = g.Path
		}
	}
	m, errV2 := detectV2(paths, ms)
	if errV2 == nil {
		return m, nil
	}
	m, errV1 := detectV1(paths, ms)
	if errV1 == nil {
		return m, nil
	}
	return nil, unavailable("%v; %v", errV2, errV1)
}

// V2 reports whether m creates groups on cgroup v2, where a process can
// be started inside its group (Group.FD).
func (m *Manager) V2() bool { return m.base != "" }

// Enforces reports which of Limits the kernel enforces through m's groups.
func (m *Manager) Enforces() (memory, processes bool) {
	if m.V2() {
		return true, true
	}
	return m.memBase != "", m.pidsBase != ""
}

// String describes where m creates groups.
func (m *Manager) String() string {
	if m.V2() {
		return "cgroup v2 under " + m.base
	}
	var parts []string
	if m.memBase != "" {
		parts = append(parts, "memory under "+m.memBase)
	}
	if m.pidsBase != "" {
		parts = append(parts, "pids under "+m.pidsBase)
	}
	return "cgroup v1 (" + strings.Join(parts, ", ") + ")"
}

// Group is one run's control group.
type Group struct {
	// dirs are the group's directories: one on v2, one per controller on
	// v1. procs is the one whose cgroup.procs lists the members.
	dirs  []string
	procs string
	// memEvents and pidsEvents are the files counting OOM kills and
	// refused forks; "" without that controller.
	memEvents, pidsEvents string
	hasKill               bool // procs has cgroup.kill (v2, Linux 5.14)
	// fd is the v2 directory opened for CLONE_INTO_CGROUP; -1 on v1.
	fd      int
	removed bool
}

// New creates the group name with lim. Call Remove when done with it.
func (m *Manager) New(name string, lim Limits) (*Group, error) {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return nil, fmt.Errorf("cgroup: invalid group name %q", name)
	}
	g := &Group{fd: -1}
	if err := g.create(m, name, lim); err != nil {
		_ = g.Remove()
		return nil, err
	}
	return g, nil
}

// create makes g's directories and writes its limits; on error, g holds
// what was made, for Remove.
func (g *Group) create(m *Manager, name string, lim Limits) error {
	mk := func(base string) (string, error) {
		dir := filepath.Join(base, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return "", fmt.Errorf("cgroup: %w", err)
		}
		g.dirs = append(g.dirs, dir)
		return dir, nil
	}
	if m.V2() {
		dir, err := mk(m.base)
		if err != nil {
			return err
		}
		g.procs, g.memEvents, g.pidsEvents = dir, filepath.Join(dir, "memory.events"), filepath.Join(dir, "pids.events")
		if g.fd, err = unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
			g.fd = -1
			return fmt.Errorf("cgroup: open %s: %w", dir, err)
		}
		_, err = os.Stat(filepath.Join(dir, "cgroup.kill"))
		g.hasKill = err == nil
		if lim.Memory > 0 {
			if err := write(dir, "memory.max", strconv.FormatInt(lim.Memory, 10)); err != nil {
				return err
			}
			// Without this the limit only bounds RAM and the rest pages
			// out; absent when swap is not accounted.
			_ = write(dir, "memory.swap.max", "0")
			// One OOM kill takes the whole run: it is over anyway.
			_ = write(dir, "memory.oom.group", "1")
		}
		if lim.Processes > 0 {
			return write(dir, "pids.max", strconv.Itoa(lim.Processes))
		}
		return nil
	}
	if m.memBase != "" {
		dir, err := mk(m.memBase)
		if err != nil {
			return err
		}
		// oom_kill is in memory.oom_control since Linux 4.13.
		g.procs, g.memEvents = dir, filepath.Join(dir, "memory.oom_control")
		if lim.Memory > 0 {
			if err := write(dir, "memory.limit_in_bytes", strconv.FormatInt(lim.Memory, 10)); err != nil {
				return err
			}
			// Must follow limit_in_bytes (it may not be below it); absent
			// without swap accounting.
			_ = write(dir, "memory.memsw.limit_in_bytes", strconv.FormatInt(lim.Memory, 10))
		}
	}
	if m.pidsBase != "" {
		dir, err := mk(m.pidsBase)
		if err != nil {
			return err
		}
		// The pids group counts every process, so it is the better list of
		// members to kill.
		g.procs, g.pidsEvents = dir, filepath.Join(dir, "pids.events")
		if lim.Processes > 0 {
			return write(dir, "pids.max", strconv.Itoa(lim.Processes))
		}
	}
	return nil
}

// FD is the group's directory, open, on cgroup v2: a process started with
// syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: g.FD()} is created in
// the group (clone3's CLONE_INTO_CGROUP), so nothing it runs is ever
// outside it. It is -1 on v1, which has no such start; there Add moves a
// process in.
func (g *Group) FD() int { return g.fd }

// Add moves process pid into the group. A process it forked before stays
// where it was, so add a process before it runs (execagent stops it at its
// exec); one started with FD needs no Add.
func (g *Group) Add(pid int) error {
	for _, dir := range g.dirs {
		if err := write(dir, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// Events reads what the kernel refused the group so far.
func (g *Group) Events() (Events, error) {
	var ev Events
	var errs []error
	for _, c := range []struct {
		file, key string
		n         *int
	}{{g.memEvents, "oom_kill", &ev.OOMKills}, {g.pidsEvents, "max", &ev.ForkFailures}} {
		if c.file == "" {
			continue
		}
		if b, err := os.ReadFile(c.file); err != nil {
			errs = append(errs, err)
		} else {
			*c.n = readKeyed(string(b), c.key)
		}
	}
	return ev, errors.Join(errs...)
}

// Kill sends SIGKILL to every process in the group until none is left or
// the deadline passes, and reports whether it is empty. A process forking
// as fast as it can is caught by the next pass: its children join the group
// it is in.
func (g *Group) Kill(deadline time.Duration) bool {
	if g.procs == "" {
		return true
	}
	if g.hasKill {
		_ = write(g.procs, "cgroup.kill", "1")
	}
	stop := time.Now().Add(deadline)
	for {
		pids, err := g.members()
		if err != nil || len(pids) == 0 {
			return err == nil
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if time.Now().After(stop) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (g *Group) members() ([]int, error) {
	b, err := os.ReadFile(filepath.Join(g.procs, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for f := range strings.FieldsSeq(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// Remove kills what is left in the group and removes its directories. The
// kernel refuses to remove a group until its last process has been reaped,
// which may take a moment after SIGKILL.
func (g *Group) Remove() error {
	if g.removed {
		return nil
	}
	g.removed = true
	g.Kill(2 * time.Second)
	var errs []error
	if g.fd >= 0 {
		errs = append(errs, unix.Close(g.fd))
		g.fd = -1
	}
	for _, dir := range slices.Backward(g.dirs) {
		err := os.Remove(dir)
		for try := 0; err != nil && !errors.Is(err, os.ErrNotExist) && try < 200; try++ {
			time.Sleep(10 * time.Millisecond)
			err = os.Remove(dir)
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("cgroup: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Dirs are the group's directories (for logs and tests).
func (g *Group) Dirs() []string { return slices.Clone(g.dirs) }

func write(dir, name, value string) error {
	// cgroupfs files exist already; O_TRUNC is meaningless there and
	// refused by some.
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("cgroup: %w", err)
	}
	_, werr := f.WriteString(value)
	if err := errors.Join(werr, f.Close()); err != nil {
		return fmt.Errorf("cgroup: write %q to %s: %w", value, filepath.Join(dir, name), err)
	}
	return nil
}

// mountinfoEscapes undoes the octal escapes mountinfo writes for the
// characters that would split its fields; procfs leaves them in.
var mountinfoEscapes = strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)

// dirOf is where path, as /proc/self/cgroup names it, is under mount m.
func dirOf(m *procfs.MountInfo, path string) (string, bool) {
	rel := path
	if root := mountinfoEscapes.Replace(m.Root); root != "/" {
		var ok bool
		if rel, ok = strings.CutPrefix(path, root); !ok {
			return "", false
		}
	}
	return filepath.Join(mountinfoEscapes.Replace(m.MountPoint), rel), true
}

func detectV2(paths map[string]string, ms []*procfs.MountInfo) (*Manager, error) {
	path, ok := paths[""]
	if !ok {
		return nil, errors.New("v2: osmo is in no v2 group")
	}
	for _, m := range ms {
		if m.FSType != "cgroup2" {
			continue
		}
		base, ok := dirOf(m, path)
		if !ok {
			continue
		}
		b, err := os.ReadFile(filepath.Join(base, "cgroup.controllers"))
		if err != nil {
			return nil, fmt.Errorf("v2: %v", err)
		}
		have := strings.Fields(string(b))
		if !slices.Contains(have, "memory") || !slices.Contains(have, "pids") {
			return nil, fmt.Errorf("v2: %s offers controllers %q, not memory and pids", base, have)
		}
		if err := enableV2(base); err != nil {
			return nil, fmt.Errorf("v2: %v", err)
		}
		if err := probe(base); err != nil {
			return nil, fmt.Errorf("v2: %v", err)
		}
		return &Manager{base: base}, nil
	}
	return nil, errors.New("v2: no cgroup2 filesystem mounted")
}

// enableV2 turns on the memory and pids controllers for base's children.
func enableV2(base string) error {
	b, err := os.ReadFile(filepath.Join(base, "cgroup.subtree_control"))
	if err != nil {
		return err
	}
	on := strings.Fields(string(b))
	if slices.Contains(on, "memory") && slices.Contains(on, "pids") {
		return nil
	}
	err = write(base, "cgroup.subtree_control", "+memory +pids")
	if !errors.Is(err, syscall.EBUSY) {
		return err
	}
	// No internal processes: move base's processes (osmo, and whatever
	// shares its group) into a leaf, then try again.
	leaf := filepath.Join(base, "osmo")
	if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	procs, err := os.ReadFile(filepath.Join(base, "cgroup.procs"))
	if err != nil {
		return err
	}
	for pid := range strings.FieldsSeq(string(procs)) {
		// A process that exited meanwhile is ESRCH; anything else shows
		// up in the retry below.
		_ = write(leaf, "cgroup.procs", pid)
	}
	return write(base, "cgroup.subtree_control", "+memory +pids")
}

func detectV1(paths map[string]string, ms []*procfs.MountInfo) (*Manager, error) {
	mgr := &Manager{}
	var reasons []string
	for _, c := range []struct {
		ctrl string
		base *string
	}{{"memory", &mgr.memBase}, {"pids", &mgr.pidsBase}} {
		ctrl := c.ctrl
		path, ok := paths[ctrl]
		if !ok {
			reasons = append(reasons, "v1: osmo is in no "+ctrl+" group")
			continue
		}
		i := slices.IndexFunc(ms, func(m *procfs.MountInfo) bool {
			_, has := m.SuperOptions[ctrl]
			_, under := dirOf(m, path)
			return m.FSType == "cgroup" && has && under
		})
		if i < 0 {
			reasons = append(reasons, "v1: no "+ctrl+" hierarchy mounted")
			continue
		}
		base, _ := dirOf(ms[i], path)
		if err := probe(base); err != nil {
			reasons = append(reasons, fmt.Sprintf("v1 %s: %v", ctrl, err))
			continue
		}
		*c.base = base
	}
	if mgr.memBase == "" && mgr.pidsBase == "" {
		return nil, errors.New(strings.Join(reasons, "; "))
	}
	return mgr, nil
}

// probe creates and removes a group in base.
func probe(base string) error {
	dir := filepath.Join(base, fmt.Sprintf("osmo-probe-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	return os.Remove(dir)
}
