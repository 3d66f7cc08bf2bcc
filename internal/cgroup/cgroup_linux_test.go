package cgroup

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	paths := parseProcCgroup("8:pids:/\n4:memory:/a/b\n1:cpu,cpuacct:/c\n0::/u\n")
	if paths["pids"] != "/" || paths["memory"] != "/a/b" || paths["cpuacct"] != "/c" || paths[""] != "/u" {
		t.Errorf("parseProcCgroup: %v", paths)
	}
	ms := parseMountinfo("30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n" +
		"31 25 0:27 /x /sys/fs/cgroup/un\\040ified rw - cgroup2 cgroup2 rw\n" +
		"32 25 8:1 / / rw - ext4 /dev/sda rw\n")
	if len(ms) != 2 || ms[0].point != "/sys/fs/cgroup/memory" || ms[0].opts[1] != "memory" || ms[1].point != "/sys/fs/cgroup/un ified" || ms[1].root != "/x" {
		t.Errorf("parseMountinfo: %+v", ms)
	}
	if d, ok := dirOf(ms[1], "/x/y"); !ok || d != "/sys/fs/cgroup/un ified/y" {
		t.Errorf("dirOf: %q %v", d, ok)
	}
	if n := readKeyed("low 0\nmax 3\noom_kill 2\n", "oom_kill"); n != 2 {
		t.Errorf("readKeyed: %d", n)
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
