//go:build unix

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestPythonTrainerAgainstOsmo runs the Python trainer example against a
// running osmo serve: it streams the rows of finished rollouts, is killed
// while its stream waits for more, restarts from its state, and in the end
// has trained on every row the server holds exactly once, with each
// rollout's group advantages summing to 0.
func TestPythonTrainerAgainstOsmo(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end")
	}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is not on PATH: %v", err)
	}
	trainer, err := filepath.Abs(filepath.Join("..", "examples", "python-trainer", "trainer.py"))
	if err != nil {
		t.Fatal(err)
	}
	mockAddr := startMockPolicy(t)
	srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", "multiply", "--grader", "multiply",
		"--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")
	ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
		PolicyURL: "http://" + mockAddr + "/v1", CallbackKey: "K-callbacks", CallbackTimeout: 60 * time.Second, Logger: quietLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)

	// Two waves of rollouts: the trainer is killed between them, while its
	// stream waits for more.
	const n = 8
	var want []string
	wave := func(from, to int) {
		var wg sync.WaitGroup
		errs := make([]error, to)
		for i := from; i < to; i++ {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
				defer cancel()
				label := fmt.Sprint((i + 2) * 7)
				res, err := ctl.Run(ctx, base, serverKey, controller.V03RunRequest{
					RolloutID: fmt.Sprintf("trainer-%d", i),
					Messages:  []map[string]any{{"role": "user", "content": fmt.Sprintf("What is %d times 7?", i+2)}},
					Label:     &label,
				})
				if err == nil && res.Status != "success" {
					err = fmt.Errorf("status %q", res.Status)
				}
				errs[i] = err
			})
		}
		wg.Wait()
		for i := from; i < to; i++ {
			if errs[i] != nil {
				t.Fatalf("rollout %d: %v\nserver output:\n%s", i, errs[i], srv.Output())
			}
			for _, r := range getRows(t, base, fmt.Sprintf("trainer-%d", i), "") {
				want = append(want, fmt.Sprintf("%s/%s/%d", r.RolloutID, r.SampleID, r.Row))
			}
		}
	}

	state := t.TempDir()
	run := func(ctx context.Context, extra ...string) *exec.Cmd {
		args := append([]string{trainer, "--url", base, "--api-key", serverKey, "--state", state, "--batch-rows", "3", "--idle", "1"}, extra...)
		cmd := exec.CommandContext(ctx, py, args...)
		cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
		cmd.WaitDelay = 5 * time.Second
		return cmd
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	wave(0, n/2)
	first := run(ctx)
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	for committed(t, state) < len(want) {
		if ctx.Err() != nil {
			t.Fatalf("the trainer committed %d of the first wave's %d rows", committed(t, state), len(want))
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = syscall.Kill(-first.Process.Pid, syscall.SIGKILL)
	_ = first.Wait()

	// The second run resumes from its cursor and stops once every row of
	// both waves is in.
	wave(n/2, n)
	out, err := run(ctx, "--max-rows", fmt.Sprint(len(want))).CombinedOutput()
	if err != nil {
		t.Fatalf("trainer: %v\n%s", err, out)
	}

	var got []string
	f, err := os.Open(filepath.Join(state, "steps.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var step struct {
			Rows      []string           `json:"rows"`
			GroupSums map[string]float64 `json:"group_advantage_sums"`
		}
		if err := json.Unmarshal(sc.Bytes(), &step); err != nil {
			t.Fatal(err)
		}
		got = append(got, step.Rows...)
		for g, s := range step.GroupSums {
			if s > 1e-9 || s < -1e-9 {
				t.Errorf("group %s: advantages sum to %v, want 0", g, s)
			}
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("the trainer took rows %q, want each of %q once", got, want)
	}
}

// committed reads how many rows the trainer has committed (0 before its
// first step).
func committed(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		return 0
	}
	var s struct {
		Rows int `json:"rows"`
	}
	if json.Unmarshal(b, &s) != nil {
		return 0
	}
	return s.Rows
}
