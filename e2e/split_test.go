package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/natsstore"
)

// TestSplitDeploymentSurvivesGraderRestart runs osmo rollout, osmo grader and
// osmo gateway as separate processes, kills the grader (SIGKILL) while
// rollouts are finishing and starts it again on the same address: every
// rollout must still get its reward, and no sample may be graded twice.
func TestSplitDeploymentSurvivesGraderRestart(t *testing.T) {
	// Latency spreads the rollouts out so some finish while the grader is down.
	mockAddr := startMockPolicy(t, "--latency", "40ms")

	ctl := startG1Controller(t, controller.Options{PolicyURL: "http://" + mockAddr + "/v1"})

	stateDir := t.TempDir()
	graderArgs := func(addr string) []string {
		return []string{"grader", "--grpc-addr", addr, "--metrics-addr", "127.0.0.1:0", "--grader", "calculator", "--state", stateDir, "--log-level", "debug"}
	}
	grader1, addrs := startListening(t, "grader-1", nil, graderArgs("127.0.0.1:0")...)
	graderAddr := addrs["grpc"]
	waitGRPC(t, grader1, graderAddr)
	roll, addrs := startListening(t, "rollout", nil, "rollout", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--grader-addr", graderAddr,
		"--workflow", "calculator", "--max-concurrent", "4", "--log-level", "warn")
	rolloutAddr, rolloutMetrics := addrs["grpc"], addrs["metrics"]
	waitGRPC(t, roll, rolloutAddr)
	gw, addrs := startListening(t, "gateway", nil, "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", rolloutAddr, "--grader-addr", graderAddr, "--log-level", "warn")
	base := addrs["http"]
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
	// others finish, then bring it back on the same address and state.
	wctx, wcancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer wcancel()
	if _, err := ctl.Wait(wctx, ids[2]); err != nil {
		t.Fatal(err)
	}
	grader1.Stop(syscall.SIGKILL, time.Second)
	time.Sleep(600 * time.Millisecond)
	// The second grader takes the first one's address.
	grader2 := start(t, "grader-2", nil, graderArgs(graderAddr)...)
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
	if countLines(grader2.Output(), `"msg":"graded"`) == 0 {
		t.Fatal("the restarted grader graded nothing: the kill did not land mid-run")
	}
	// Each rollout was graded by exactly one grader run; any resend was
	// answered from the stored grading. The gradings bucket is the record
	// of committed gradings (stored before any answer; the "graded" log line
	// follows, so a SIGKILL can land between the two and logs undercount).
	grader2.Stop(syscall.SIGTERM, 10*time.Second)
	stored, writes := storedGradings(t, stateDir)
	for _, id := range ids {
		if !stored[id] {
			t.Errorf("%s: no successful grading stored", id)
		}
	}
	if len(stored) != n || writes != n {
		t.Errorf("the bucket holds gradings of %d rollouts from %d writes, want %d from %d (one grading each): %v", len(stored), writes, n, n, stored)
	}
	metrics := httpGet(t, rolloutMetrics+"/metrics")
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

// storedGradings reads the grader's state in dir (the embedded NATS's
// files; no grader may be running on it): which rollouts have a successful
// grading, and how many writes the bucket took in all. A rollout's gradings
// are one key, rewritten by each grading of it, so a rollout graded twice
// shows as one write too many.
func storedGradings(t *testing.T, dir string) (map[string]bool, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	kv, err := st.JS.KeyValue(ctx, "osmo_gradings")
	if err != nil {
		t.Fatal(err)
	}
	status, err := kv.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for key := range keys.Keys() {
		e, err := kv.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		var gs []struct {
			RolloutID string `json:"rollout_id"`
			Error     string `json:"error"`
		}
		if err := json.Unmarshal(e.Value(), &gs); err != nil {
			t.Fatalf("gradings under %s: %v: %s", key, err, e.Value())
		}
		for _, g := range gs {
			if g.Error == "" {
				out[g.RolloutID] = true
			}
		}
	}
	return out, int(status.(*jetstream.KeyValueBucketStatus).StreamInfo().State.LastSeq)
}
