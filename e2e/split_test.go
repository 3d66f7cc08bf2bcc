package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestSplitDeploymentSurvivesGraderRestart runs osmo rollout, osmo grader and
// osmo gateway as separate processes, kills the grader (SIGKILL) while
// rollouts are finishing and starts it again on the same address: every
// rollout must still get its reward, and no sample may be graded twice.
func TestSplitDeploymentSurvivesGraderRestart(t *testing.T) {
	// Latency spreads the rollouts out so some finish while the grader is down.
	mockAddr := startMockPolicy(t, "--latency", "40ms")

	ctl := startG1Controller(t, controller.Options{PolicyURL: "http://" + mockAddr + "/v1"})

	journal := filepath.Join(t.TempDir(), "grades.jsonl")
	graderAddr, rolloutAddr, gwAddr, rolloutMetrics := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	graderArgs := []string{"grader", "--grpc-addr", graderAddr, "--metrics-addr", "127.0.0.1:0", "--grader", "calculator", "--journal", journal, "--log-level", "debug"}
	grader1 := start(t, "grader-1", nil, graderArgs...)
	waitGRPC(t, grader1, graderAddr)
	roll := start(t, "rollout", nil, "rollout", "--grpc-addr", rolloutAddr, "--metrics-addr", rolloutMetrics, "--grader-addr", graderAddr,
		"--workflow", "calculator", "--max-concurrent", "4", "--log-level", "warn")
	waitGRPC(t, roll, rolloutAddr)
	gw := start(t, "gateway", nil, "gateway", "--addr", gwAddr, "--rollout-addr", rolloutAddr, "--grader-addr", graderAddr, "--log-level", "warn")
	base := "http://" + gwAddr
	waitHTTP(t, gw, base+"/health")

	const n = 24
	ids := make([]string, n)
	for i := range n {
		ids[i] = fmt.Sprintf("split-%02d", i)
		a, b := i+2, i+3
		ictx, icancel := context.WithTimeout(context.Background(), 10*time.Second)
		code, body, err := ctl.Init(ictx, base, "", controller.InitRequest{
			RolloutID:        ids[i],
			Messages:         []map[string]any{{"role": "user", "content": fmt.Sprintf("What is %d * %d?", a, b)}},
			CompletionParams: map[string]any{"temperature": 1.0},
			Metadata:         map[string]any{"ground_truth": fmt.Sprint(a * b)},
		})
		icancel()
		if err != nil || code != 202 {
			t.Fatalf("init %s: %d %s %v", ids[i], code, body, err)
		}
	}

	// Kill the grader once a few rollouts are graded, keep it down while
	// others finish, then bring it back on the same address and journal.
	wctx, wcancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer wcancel()
	if _, err := ctl.Wait(wctx, ids[2]); err != nil {
		t.Fatal(err)
	}
	grader1.Stop(syscall.SIGKILL, time.Second)
	time.Sleep(600 * time.Millisecond)
	grader2 := start(t, "grader-2", nil, graderArgs...)
	waitGRPC(t, grader2, graderAddr)

	for _, id := range ids {
		c, err := ctl.Wait(wctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != 1 {
			t.Errorf("%s: %s", id, c.Raw)
		}
		if got := len(ctl.Completions(id)); got != 1 {
			t.Errorf("%s: %d completions", id, got)
		}
	}
	// Each rollout was graded by exactly one grader run; any resend was
	// answered from the journal. The journal is the record of committed
	// gradings (fsync'd before any answer); the "graded" log line follows the
	// fsync, so a SIGKILL can land between the two and logs undercount.
	perRollout := journalGradings(t, journal)
	for _, id := range ids {
		if got := perRollout[id]; got != 1 {
			t.Errorf("%s: %d gradings in the journal, want exactly 1", id, got)
		}
	}
	if len(perRollout) != n {
		t.Errorf("journal holds gradings for %d rollouts, want %d: %v", len(perRollout), n, perRollout)
	}
	if countLines(grader2.Output(), `"msg":"graded"`) == 0 {
		t.Fatal("the restarted grader graded nothing: the kill did not land mid-run")
	}
	metrics := httpGet(t, "http://"+rolloutMetrics+"/metrics")
	for _, want := range []string{
		fmt.Sprintf(`osmo_rollouts_finished_total{error_category="",status="COMPLETED"} %d`, n),
		fmt.Sprintf(`osmo_rollouts_started_total %d`, n),
		`osmo_rollout_grade_duration_seconds_count{outcome="ok"} 24`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("rollout /metrics lacks %q", want)
		}
	}
}

// journalGradings counts the successful gradings per rollout id in a grader
// journal (JSON Lines, one grading per line).
func journalGradings(t *testing.T, path string) map[string]int {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var g struct {
			RolloutID string `json:"rollout_id"`
			Error     string `json:"error"`
		}
		if err := json.Unmarshal([]byte(line), &g); err != nil {
			t.Fatalf("journal line %q: %v", line, err)
		}
		if g.Error == "" {
			out[g.RolloutID]++
		}
	}
	return out
}
