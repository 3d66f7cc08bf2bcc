//go:build linux

package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/cgroup"
)

// Secrets the server has and its exec agents must never see.
const (
	containSecret   = "s3cret-osmo-test-value"
	containUpstream = "sk-upstream-never-leaks"
)

// containStack is `osmo serve --exec hostile_agent.py --exec-limits limits`.
type containStack struct {
	*g2Stack
	script string
}

func startContain(t *testing.T, python, limits string, env ...string) *containStack {
	t.Helper()
	script, err := filepath.Abs("testdata/hostile_agent.py")
	if err != nil {
		t.Fatal(err)
	}
	env = append(env,
		"OSMO_TEST_SECRET="+containSecret,
		"OSMO_UPSTREAM_API_KEY="+containUpstream,
		"AWS_SECRET_ACCESS_KEY="+containSecret,
		"OSMO_API_KEY="+serverKey,
	)
	s := startG2(t, nil, env, "--exec", python+" "+script, "--exec-limits", limits, "--grader", "multiply")
	return &containStack{g2Stack: s, script: script}
}

// rollout runs one rollout with prompt and returns its completion.
func (s *containStack) rollout(t *testing.T, id, prompt string) (status, category, message string) {
	t.Helper()
	if code, data := s.startRollout(t, id, prompt, "42", nil); code != 202 {
		t.Fatalf("%s: POST /rollout = %d %s", id, code, data)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	comp, err := s.ctl.WaitCompletion(ctx, id)
	if err != nil {
		t.Fatalf("%s: no completion: %v\nserver output:\n%s", id, err, s.srv.Output())
	}
	if comp.ErrCategory != nil {
		category = *comp.ErrCategory
	}
	if comp.ErrMessage != nil {
		message = *comp.ErrMessage
	}
	return comp.Status, category, message
}

// wantLimit checks a rollout ended as an agent_error naming limit.
func wantLimit(t *testing.T, status, category, message, limit string) {
	t.Helper()
	if status != "failure" || category != "agent_error" || !strings.Contains(message, limit) {
		t.Errorf("completion %s %s %q, want failure agent_error naming %q", status, category, message, limit)
	}
}

// afterHostile checks the server survived the hostile rollout whose
// message is message: healthy, another rollout succeeds, none of the
// agent's processes, its scratch directory or its cgroups are left.
func (s *containStack) afterHostile(t *testing.T, id, message string) {
	t.Helper()
	if body := httpGet(t, s.base+"/health"); body == "" {
		t.Errorf("/health answered nothing")
	}
	if status, category, msg := s.rollout(t, id+"-then-benign", "benign"); status != "success" {
		t.Errorf("a rollout after the hostile one: %s %s %q", status, category, msg)
	}
	waitFor(t, "no process running "+s.script, func() bool { return len(processesRunning(s.script)) == 0 })
	m := regexp.MustCompile(`HOSTILE-SCRATCH=(\S*) HOSTILE-CWD=(\S*) HOSTILE-CGROUPS=(\S*)`).FindStringSubmatch(message)
	if m == nil {
		t.Errorf("the agent's report is not in the message %q", message)
		return
	}
	if m[2] != m[1] {
		t.Errorf("the agent worked in %q, want its scratch directory %q", m[2], m[1])
	}
	if _, err := os.Stat(m[1]); m[1] == "" || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("scratch directory %q outlived the run: %v", m[1], err)
	}
	for _, dir := range cgroupDirs(m[3]) {
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s outlived the run: %v", dir, err)
		}
	}
}

// cgroupDirs are the run's own cgroup directories among the lines of
// /proc/self/cgroup the agent reported (joined by ;).
func cgroupDirs(report string) []string {
	var dirs []string
	for line := range strings.SplitSeq(report, ";") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || !strings.Contains(parts[2], "osmo-exec-") {
			continue
		}
		for _, c := range []string{"memory", "pids"} {
			if parts[1] == c {
				dirs = append(dirs, filepath.Join("/sys/fs/cgroup", c, parts[2]))
			}
		}
		if parts[1] == "" {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup", parts[2]))
		}
	}
	return dirs
}

// processesRunning lists the pids with script as an argument (the
// server's --exec has it inside a longer one).
func processesRunning(script string) []string {
	entries, _ := os.ReadDir("/proc")
	var pids []string
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && slices.Contains(strings.Split(string(cmdline), "\x00"), script) {
			pids = append(pids, e.Name())
		}
	}
	return pids
}

// requireCgroups skips unless runs get cgroups limiting memory and
// processes: without them a fork bomb would take the machine, not the run.
func requireCgroups(t *testing.T) {
	t.Helper()
	m, err := cgroup.Detect()
	if err != nil {
		t.Skipf("exec agents get no cgroup here, so the hostile agents would not be contained: %v", err)
	}
	if mem, procs := m.Enforces(); !mem || !procs {
		t.Skipf("%s does not limit both memory and processes", m)
	}
}

func python3(t *testing.T) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is needed for the hostile agents: %v", err)
	}
	return py
}

// TestContainHostileAgents runs agents that fork without end, allocate
// 8 GiB and print the server's environment: each rollout fails (or, for
// the environment, succeeds without a secret) while the server carries on.
func TestContainHostileAgents(t *testing.T) {
	requireCgroups(t)
	s := startContain(t, python3(t), "processes=64,memory=256MiB")

	t.Run("fork bomb", func(t *testing.T) {
		start := time.Now()
		status, category, msg := s.rollout(t, "contain-fork", "fork")
		wantLimit(t, status, category, msg, "process limit (processes=64)")
		if d := time.Since(start); d > 15*time.Second {
			t.Errorf("the fork bomb ran %v before its rollout ended", d)
		}
		s.afterHostile(t, "contain-fork", msg)
	})
	t.Run("8 GiB", func(t *testing.T) {
		status, category, msg := s.rollout(t, "contain-memory", "memory")
		wantLimit(t, status, category, msg, "memory limit (memory=256MiB)")
		s.afterHostile(t, "contain-memory", msg)
	})
	t.Run("environment", func(t *testing.T) {
		status, category, msg := s.rollout(t, "contain-env", "env")
		if status != "success" {
			t.Fatalf("completion %s %s %q", status, category, msg)
		}
		_, grade := s.callbacks(t, "contain-env")
		sample, ok := grade.Samples["exec"]
		if !ok || len(sample.Messages) == 0 {
			t.Fatalf("grader callback %s lacks the sample", grade.Raw)
		}
		dump := string(grade.Raw)
		if !strings.Contains(dump, "OPENAI_BASE_URL=") {
			t.Fatalf("the agent's environment is not in its sample: %s", dump)
		}
		for _, secret := range []string{containSecret, containUpstream, serverKey, "OSMO_TEST_SECRET", "AWS_SECRET_ACCESS_KEY"} {
			if strings.Contains(dump, secret) {
				t.Errorf("the agent saw %q: its sample holds it", secret)
			}
			if strings.Contains(s.srv.Output(), secret+"=") || strings.Contains(s.srv.Output(), "="+secret) {
				t.Errorf("the agent saw %q: the server's log holds it", secret)
			}
		}
		if body := httpGet(t, s.base+"/health"); body == "" {
			t.Errorf("/health answered nothing")
		}
	})
}

// TestContainWritesOutside runs an agent as an unprivileged user that
// writes into a directory of the server's user: the write fails, the
// rollout is an agent_error, nothing is written.
func TestContainWritesOutside(t *testing.T) {
	requireCgroups(t)
	if os.Geteuid() != 0 {
		t.Skip("running exec agents as another user needs a server running as root")
	}
	// The run-as user must be able to run python and read the script: a
	// python under /root (pyenv) is out of its reach.
	var py string
	for _, p := range []string{"/usr/bin/python3", "/usr/local/bin/python3"} {
		if _, err := os.Stat(p); err == nil {
			py = p
			break
		}
	}
	if py == "" {
		t.Skip("no system python3 that user 65534 can run")
	}
	outside := t.TempDir()
	if err := os.Chmod(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(outside, "escaped")
	// The agent starts in a scratch directory under the server's TMPDIR:
	// user 65534 must be able to enter it (the test's own is private).
	if err := os.Chmod(filepath.Dir(outside), 0o711); err != nil {
		t.Fatal(err)
	}
	s := startContain(t, py, "user=65534:65534,processes=64,memory=256MiB", "TMPDIR="+outside)

	status, category, msg := s.rollout(t, "contain-write", "write "+target)
	if status != "failure" || category != "agent_error" || !strings.Contains(msg, "Permission denied") {
		t.Errorf("completion %s %s %q, want failure agent_error with Permission denied", status, category, msg)
	}
	if _, err := os.Stat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the agent wrote %s: %v", target, err)
	}
	s.afterHostile(t, "contain-write", msg)
}
