//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// workspaceRollout is the example Osmosis workspace's stand-in rollout
// server (standard library Python).
const workspaceRollout = "../examples/osmosis-workspace/rollouts/multiply"

// listeningRE is the start line each server process prints.
var listeningRE = regexp.MustCompile(`\[multiply pid=(\d+)\] multiply rollout server listening on (http://\S+)`)

// osmosisServerPIDs are the pids of the server processes that printed
// their start line so far, in order.
func osmosisServerPIDs(out string) []int {
	var pids []int
	for _, m := range listeningRE.FindAllStringSubmatch(out, -1) {
		pid, _ := strconv.Atoi(m[1])
		pids = append(pids, pid)
	}
	return pids
}

// osmosisRun is one rollout of the test and how it ended.
type osmosisRun struct {
	id, wire string
	// status, category and message of the terminal (grader) callback.
	status, category, message string
	reward                    *float64
	extra                     map[string]any
	llmCalls                  int // in the callback's sample; -1 when it has none
	completions, graders      int
	err                       error
}

// TestOsmosisRolloutHosted serves the example workspace's Python rollout
// server, unchanged, under `osmo serve --osmosis-rollout` with two server
// processes, and drives it with the v0.3 and the G2 controller at once
// while one server process is SIGKILLed mid-run: every rollout ends with
// exactly one completion and one grader callback; the rollouts the killed
// process held end as agent_error naming it, the others succeed with the
// server's reward, the [env] the process got and every LLM call the policy
// served recorded in their sample; the process is restarted and later
// rollouts succeed on it.
func TestOsmosisRolloutHosted(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Python rollout servers")
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 is not on PATH")
	}
	mockAddr := startMockPolicy(t)
	policy := "http://" + mockAddr + "/v1"
	srv, addrs := startListening(t, "serve", []string{"MULTIPLY_SECRET=s3cret-value", "MULTIPLY_GREETING=hello from env", "MULTIPLY_TURN_DELAY_SEC=0.5"},
		"serve", "--osmosis-rollout", workspaceRollout, "--osmosis-rollout-procs", "2",
		"--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")
	pids := osmosisServerPIDs(srv.Output())
	if len(pids) != 2 {
		t.Fatalf("%d server processes started, want 2:\n%s", len(pids), srv.Output())
	}

	v03, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
		PolicyURL: policy, CallbackKey: "K-callbacks", LLMKey: "K-llm", CallbackTimeout: 90 * time.Second, Logger: quietLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, v03.Serve)
	g2 := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})

	// Phase 1: 16 rollouts, half on each wire; one process is killed while
	// it holds some of them.
	victim := pids[1]
	runs := driveOsmosis(t, base, v03, g2, "p1", 16, func() {
		waitOsmosisRunning(t, srv, pids, 12)
		if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	failed, succeeded := 0, 0
	for _, r := range runs {
		checkOneCallbackSet(t, r)
		switch r.status {
		case "success":
			succeeded++
			checkOsmosisSuccess(t, r)
		default:
			failed++
			if r.category != "agent_error" || !strings.Contains(r.message, fmt.Sprintf("rollout server (pid %d) died while running the rollout", victim)) {
				t.Errorf("%s (%s): %s %s: %s", r.id, r.wire, r.status, r.category, r.message)
			}
		}
	}
	if failed == 0 || succeeded == 0 {
		t.Errorf("%d rollouts failed and %d succeeded; want the killed process's to fail and the others to succeed", failed, succeeded)
	}
	checkLLMCallsRecorded(t, runs, v03, g2)

	// The killed process is restarted.
	deadline := time.Now().Add(30 * time.Second)
	for len(osmosisServerPIDs(srv.Output())) < 3 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	now := osmosisServerPIDs(srv.Output())
	if len(now) != 3 {
		t.Fatalf("the killed server was not restarted: pids %v\n%s", now, tail(srv.Output(), 4000))
	}
	restarted := now[2]
	// osmo polls a new process's /health every 0.2 s before it hands it
	// rollouts: wait for it to answer, and a little more.
	waitOsmosisRunning(t, srv, []int{restarted}, 0)
	time.Sleep(500 * time.Millisecond)
	if !strings.Contains(srv.Output(), "osmosis rollout server died; restarting it") {
		t.Errorf("no log of the restart")
	}

	// Phase 2: later rollouts all succeed, on both processes.
	runs = driveOsmosis(t, base, v03, g2, "p2", 8, nil)
	onRestarted := 0
	for _, r := range runs {
		checkOneCallbackSet(t, r)
		if r.status != "success" {
			t.Errorf("after the restart: %s (%s): %s %s: %s", r.id, r.wire, r.status, r.category, r.message)
			continue
		}
		checkOsmosisSuccess(t, r)
		if r.extra["server_pid"] == float64(restarted) {
			onRestarted++
		}
	}
	if onRestarted == 0 {
		t.Errorf("no rollout ran on the restarted process %d", restarted)
	}
	checkLLMCallsRecorded(t, runs, v03, g2)

	// A G1 trainer's rollouts reach the server too, the label taken from
	// metadata.ground_truth; the server's reward is the completion's.
	g1 := startG1Controller(t, controller.Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})
	for i := range 4 {
		id := fmt.Sprintf("osmosis-g1-%d", i)
		a, b := 3+i, 4+i
		truth, want := a*b, 1.0
		if i%2 == 1 {
			truth, want = truth+1, 0
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		code, body, err := g1.Init(ctx, base, serverKey, controller.InitRequest{
			RolloutID:        id,
			Messages:         []map[string]any{{"role": "user", "content": fmt.Sprintf("What is %d times %d?", a, b)}},
			CompletionParams: map[string]any{},
			Metadata:         map[string]any{"ground_truth": strconv.Itoa(truth)},
		})
		if err != nil || code != 202 {
			cancel()
			t.Fatalf("init %s: %d %s %v", id, code, body, err)
		}
		c, err := g1.Wait(ctx, id)
		cancel()
		if err != nil || c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != want || len(c.FinalMessages) != 4 || len(g1.Completions(id)) != 1 {
			t.Errorf("G1 %s: %+v %v", id, c, err)
		}
	}
	// Shutdown drains: rollouts running when osmo gets SIGTERM finish on
	// their servers, which are stopped only afterwards.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range 2 {
		id := fmt.Sprintf("osmosis-drain-%d", i)
		body := g2.StartBody(id, []map[string]any{{"role": "user", "content": "What is 6 times 7?"}})
		body["label"] = "42"
		if code, _, data, err := g2.Start(ctx, base, serverKey, body); err != nil || code != 202 {
			t.Fatalf("start %s: %d %s %v", id, code, data, err)
		}
	}
	waitOsmosisRunning(t, srv, []int{pids[0], restarted}, 2)
	srv.Stop(syscall.SIGTERM, 30*time.Second)
	for i := range 2 {
		id := fmt.Sprintf("osmosis-drain-%d", i)
		gc, err := g2.WaitGrader(ctx, id)
		if err != nil || gc.Status != "success" {
			t.Errorf("%s during the drain: %+v %v", id, gc, err)
		}
	}
	if srv.ExitCode() != 0 {
		t.Errorf("osmo serve exited with %d after SIGTERM", srv.ExitCode())
	}
	for _, pid := range osmosisServerPIDs(srv.Output()) {
		if !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			t.Errorf("server process %d outlived osmo serve", pid)
		}
	}
	if strings.Contains(srv.Output(), "s3cret-value") {
		t.Errorf("the secret reached the output")
	}
}

// driveOsmosis runs n rollouts, alternating v0.3 and G2, all at once, and
// calls during (when not nil) once they were all admitted.
func driveOsmosis(t *testing.T, base string, v03 *controller.V03, g2 *controller.G2, prefix string, n int, during func()) []*osmosisRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	runs := make([]*osmosisRun, n)
	var admitted, done sync.WaitGroup
	for i := range n {
		a, b := 2+i%9, 3+i%7
		prompt := fmt.Sprintf("What is %d times %d?", a, b)
		label := strconv.Itoa(a * b)
		r := &osmosisRun{id: fmt.Sprintf("osmosis-%s-%02d", prefix, i), llmCalls: -1}
		runs[i] = r
		msgs := []map[string]any{{"role": "user", "content": prompt}}
		admitted.Add(1)
		if i%2 == 0 {
			r.wire = "v0.3"
			done.Go(func() {
				// Run admits and then waits; admission is quick.
				time.AfterFunc(300*time.Millisecond, admitted.Done)
				res, err := v03.Run(ctx, base, serverKey, controller.V03RunRequest{RolloutID: r.id, Messages: msgs, Label: &label})
				r.err = err
				r.status = res.Status
				if res.ErrCategory != nil {
					r.category = *res.ErrCategory
				}
				if res.ErrMessage != nil {
					r.message = *res.ErrMessage
				}
				if res.Sample != nil {
					r.reward, r.extra = res.Sample.Reward, res.Sample.ExtraFields
					var raw struct {
						LLMCalls []json.RawMessage `json:"llm_calls"`
					}
					if json.Unmarshal(res.Sample.Raw, &raw) == nil {
						r.llmCalls = len(raw.LLMCalls)
					}
				}
				r.completions, r.graders = len(v03.Completions(r.id)), len(v03.GraderCallbacks(r.id))
			})
			continue
		}
		r.wire = "g2"
		done.Go(func() {
			body := g2.StartBody(r.id, msgs)
			body["label"] = label
			code, _, data, err := g2.Start(ctx, base, serverKey, body)
			admitted.Done()
			if err != nil || code != 202 {
				r.err = fmt.Errorf("start: %d %s %v", code, data, err)
				return
			}
			gc, err := g2.WaitGrader(ctx, r.id)
			if err != nil {
				r.err = err
				return
			}
			r.status = gc.Status
			if gc.ErrCategory != nil {
				r.category = *gc.ErrCategory
			}
			if gc.ErrMessage != nil {
				r.message = *gc.ErrMessage
			}
			for _, s := range gc.Samples {
				r.reward, r.extra, r.llmCalls = s.Reward, s.ExtraFields, len(s.LLMCalls)
			}
			if _, err := g2.WaitCompletion(ctx, r.id); err != nil {
				r.err = err
			}
			// Late duplicates would arrive within the delivery retries.
			time.Sleep(100 * time.Millisecond)
			r.completions, r.graders = len(g2.Completions(r.id)), len(g2.GraderCallbacks(r.id))
		})
	}
	admitted.Wait()
	if during != nil {
		during()
	}
	done.Wait()
	for _, r := range runs {
		if r.err != nil {
			t.Errorf("%s (%s): %v", r.id, r.wire, r.err)
		}
	}
	return runs
}

// waitOsmosisRunning waits until the server processes together report at
// least n rollouts running on their /health, each holding some (n = 0:
// until each answers).
func waitOsmosisRunning(t *testing.T, srv *proc, pids []int, n int) {
	t.Helper()
	urls := map[int]string{}
	for _, m := range listeningRE.FindAllStringSubmatch(srv.Output(), -1) {
		pid, _ := strconv.Atoi(m[1])
		urls[pid] = m[2]
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		total, all, allUp := 0, true, true
		for _, pid := range pids {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			code, body, err := getJSON(ctx, urls[pid]+"/health")
			cancel()
			running, up := 0, err == nil && code == 200
			if c, ok := body["concurrency"].(map[string]any); ok && up {
				r, _ := c["running"].(float64)
				running = int(r)
			}
			total += running
			all = all && running > 0
			allUp = allUp && up
		}
		if n == 0 && allUp || n > 0 && total >= n && all {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the server processes never ran %d rollouts together:\n%s", n, tail(srv.Output(), 4000))
}

func checkOneCallbackSet(t *testing.T, r *osmosisRun) {
	t.Helper()
	if r.completions != 1 || r.graders != 1 {
		t.Errorf("%s (%s): %d completion and %d grader callbacks, want one each", r.id, r.wire, r.completions, r.graders)
	}
}

func checkOsmosisSuccess(t *testing.T, r *osmosisRun) {
	t.Helper()
	if r.reward == nil || *r.reward != 1 || r.extra["greeting"] != "hello from env" || r.llmCalls != 2 {
		t.Errorf("%s (%s): reward %v, extra %v, %d LLM calls; want the server's reward 1, its greeting and 2 calls", r.id, r.wire, r.reward, r.extra, r.llmCalls)
	}
}

// checkLLMCallsRecorded: for every rollout whose callback carries a
// sample, the LLM calls recorded in it are the calls the policy served for
// it through the controller.
func checkLLMCallsRecorded(t *testing.T, runs []*osmosisRun, v03 *controller.V03, g2 *controller.G2) {
	t.Helper()
	served := map[string]int{}
	for _, c := range v03.Chats() {
		served[c.RolloutID]++
	}
	for _, c := range g2.Chats() {
		served[c.Header.Get("X-Rollout-Id")]++
	}
	for _, r := range runs {
		if r.llmCalls >= 0 && r.llmCalls != served[r.id] {
			t.Errorf("%s (%s): %d LLM calls recorded, %d served", r.id, r.wire, r.llmCalls, served[r.id])
		}
	}
}
