//go:build unix

package examples_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestPythonTrainerUnits runs python-trainer's own tests (python3 -m
// unittest): the tensors, the committed state, and the trainer streaming
// from a stand-in for osmo's row stream, killed mid-stream and restarted.
func TestPythonTrainerUnits(t *testing.T) {
	argv := python("python-trainer/test_trainer.py")(t)
	dir := filepath.Dir(argv[1])
	// Read here so that go test's cache sees a change to the Python files
	// (it tracks what the test process opens, not what its children do).
	for _, f := range []string{"trainer.py", "test_trainer.py"} {
		if _, err := os.ReadFile(filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], "-m", "unittest", "discover", "-s", dir, "-v")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	// The tests start trainer processes of their own: the whole group
	// goes when the run does.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	if err != nil {
		t.Fatalf("python3 -m unittest: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`(?m)^Ran (\d+) tests? in .*\n\nOK`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no passing unittest run in the output:\n%s", out)
	}
	if n, _ := strconv.Atoi(string(m[1])); n < 15 {
		t.Errorf("ran %d tests, want the 15 or more of test_trainer.py:\n%s", n, out)
	}
}
