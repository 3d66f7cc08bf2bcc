package cgroup

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/procfs"
)

func TestParse(t *testing.T) {
	m := &procfs.MountInfo{Root: "/x", MountPoint: `/sys/fs/cgroup/un\040ified`, FSType: "cgroup2"}
	if d, ok := dirOf(m, "/x/y"); !ok || d != "/sys/fs/cgroup/un ified/y" {
		t.Errorf("dirOf: %q %v", d, ok)
	}
	if d, ok := dirOf(m, "/elsewhere"); ok {
		t.Errorf("dirOf outside the mount's root: %q", d)
	}
	if n := readKeyed("low 0\nmax 3\noom_kill 2\n", "oom_kill"); n != 2 {
		t.Errorf("readKeyed: %d", n)
	}
}

// TestDetectReadsThisHost checks Detect against what the kernel says about
// this process: it either finds a hierarchy whose groups live under
// osmo's own, or says why none is usable.
func TestDetectReadsThisHost(t *testing.T) {
	m, err := Detect()
	if err != nil {
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("Detect error %v does not wrap ErrUnavailable", err)
		}
		t.Skip(err)
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	// The kernel's own lines, read without procfs: controller list to path.
	paths := map[string]string{}
	for line := range strings.Lines(string(self)) {
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		for _, c := range strings.Split(parts[1], ",") {
			paths[c] = parts[2]
		}
	}
	for base, ctrl := range map[string]string{m.base: "", m.memBase: "memory", m.pidsBase: "pids"} {
		if base == "" {
			continue
		}
		if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
			t.Errorf("%s: base %s is not a directory: %v", m, base, err)
		}
		if path, ok := paths[ctrl]; !ok || !strings.HasSuffix(base, filepath.Clean(path)) && path != "/" {
			t.Errorf("%s: base %s is not osmo's %q group %q", m, base, ctrl, path)
		}
	}
}

// v2Self is a cgroup v2 manager over osmo's own group, whatever
// controllers it offers, or a skip: the clone-into start needs only the
// hierarchy, not the memory and pids controllers Detect asks for.
func v2Self(t *testing.T) *Manager {
	t.Helper()
	self, err := procfs.Self()
	if err != nil {
		t.Skip(err)
	}
	groups, err := self.Cgroups()
	if err != nil {
		t.Skip(err)
	}
	ms, err := self.MountInfo()
	if err != nil {
		t.Skip(err)
	}
	for _, g := range groups {
		if g.HierarchyID != 0 {
			continue
		}
		for _, mnt := range ms {
			if mnt.FSType != "cgroup2" {
				continue
			}
			if base, ok := dirOf(mnt, g.Path); ok && probe(base) == nil {
				return &Manager{base: base}
			}
		}
	}
	t.Skip("no writable cgroup v2 group of osmo's")
	return nil
}

// TestStartInsideTheGroup starts a process with the group's FD and checks
// the kernel created it there, then kills it through the group.
func TestStartInsideTheGroup(t *testing.T) {
	m := v2Self(t)
	name := fmt.Sprintf("osmo-test-clone-%d", os.Getpid())
	g, err := m.New(name, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Remove()
	if g.FD() < 0 {
		t.Fatalf("a v2 group has no FD")
	}
	// Shell builtins only: the shell itself, not a child, reads where it is.
	cmd := exec.Command("/bin/sh", "-c", `while read -r l; do case $l in 0::*) echo "$l";; esac; done </proc/self/cgroup; exec sleep 30`)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: g.FD()}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start into %s: %v", g.Dirs()[0], err)
	}
	defer cmd.Wait()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	// The shell's first instruction ran inside the group.
	if !strings.HasPrefix(line, "0::") || !strings.HasSuffix(strings.TrimSpace(line), "/"+name) {
		t.Errorf("the child started in %q, want the group %s", line, name)
	}
	pids, err := g.members()
	if err != nil || len(pids) != 1 || pids[0] != cmd.Process.Pid {
		t.Errorf("group members %v (%v), want [%d]", pids, err, cmd.Process.Pid)
	}
	if !g.Kill(2 * time.Second) {
		t.Error("group not empty after Kill")
	}
	if err := cmd.Wait(); err == nil {
		t.Error("the child exited cleanly, want it killed")
	}
	if err := g.Remove(); err != nil {
		t.Error(err)
	}
	if _, err := os.Stat(g.Dirs()[0]); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still there: %v", g.Dirs()[0], err)
	}
}

// TestGroupLimitsProcesses forks past a small process limit and checks the
// counter, the kill and the removal.
func TestGroupLimitsProcesses(t *testing.T) {
	m, err := Detect()
	if errors.Is(err, ErrUnavailable) {
		t.Skip(err)
	}
	if _, procs := m.Enforces(); !procs {
		t.Skipf("%s does not limit processes", m)
	}
	g, err := m.New(fmt.Sprintf("osmo-test-%d", os.Getpid()), Limits{Processes: 8, Memory: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Remove()
	cmd := exec.Command("/bin/sh", "-c", "sleep 0.2; for i in $(seq 20); do sleep 30 & done; wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if err := g.Add(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		ev, err := g.Events()
		if err != nil {
			t.Fatal(err)
		}
		if ev.ForkFailures > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no fork failure counted: %+v", ev)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !g.Kill(2 * time.Second) {
		t.Error("group not empty after Kill")
	}
	_ = cmd.Wait()
	if err := g.Remove(); err != nil {
		t.Error(err)
	}
	for _, d := range g.Dirs() {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still there: %v", d, err)
		}
	}
}
