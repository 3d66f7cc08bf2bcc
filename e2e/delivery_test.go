//go:build unix

package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// g2Start posts a multiply rollout to base: label right for even i, wrong
// for odd ones, so the rewards can be checked.
func g2Start(t *testing.T, ctl *controller.G2, base, key, id string, i int) {
	t.Helper()
	a, b := 3+i%17, 4+i%13
	label := fmt.Sprint(a * b)
	if i%2 == 1 {
		label = fmt.Sprint(a*b + 1)
	}
	body := ctl.StartBody(id, []map[string]any{{"role": "user", "content": fmt.Sprintf("What is %d times %d?", a, b)}})
	body["label"] = label
	body["agent_timeout_sec"] = 300
	body["grader_timeout_sec"] = 300
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		code, _, data, err := ctl.Start(ctx, base, key, body)
		cancel()
		if err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
		if code == 202 {
			return
		}
		if code != 429 {
			t.Fatalf("start %s: %d %s", id, code, data)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// checkDelivered waits for every rollout's completion and grader callback
// and checks each arrived exactly once with the right reward.
func checkDelivered(t *testing.T, ctl *controller.G2, ids []string, timeout time.Duration, output func() string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for i, id := range ids {
		if _, err := ctl.WaitCompletion(ctx, id); err != nil {
			t.Fatalf("%s: %v\nserver output (tail):\n%s", id, err, tail(output(), 4000))
		}
		g, err := ctl.WaitGrader(ctx, id)
		if err != nil {
			t.Fatalf("%s: %v\nserver output (tail):\n%s", id, err, tail(output(), 4000))
		}
		want := 1.0
		if i%2 == 1 {
			want = 0
		}
		s, ok := g.Samples["multiply-agent"]
		if g.Status != "success" || !ok || s.Reward == nil || *s.Reward != want {
			t.Errorf("%s: grader callback %s, want success with reward %v", id, g.Raw, want)
		}
	}
	time.Sleep(500 * time.Millisecond) // a duplicate would have come by now
	for _, id := range ids {
		if n, m := len(ctl.Completions(id)), len(ctl.GraderCallbacks(id)); n != 1 || m != 1 {
			t.Errorf("%s: %d completions and %d grader callbacks accepted, want exactly 1 each", id, n, m)
		}
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// TestDeliverySurvivesTrainerOutage: the trainer's callback endpoint is
// down for a minute, then back: every result is delivered, once.
func TestDeliverySurvivesTrainerOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("takes over a minute")
	}
	mockAddr := startMockPolicy(t)
	ctl := startController(t, controller.G2Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: controllerKey, Logger: quietLog()})
	srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", "multiply", "--grader", "multiply", "-p", "0", "-H", "127.0.0.1", "--log-level", "error")
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")

	ctl.SetDown(true)
	const n = 100
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("outage-%03d", i)
		g2Start(t, ctl, base, "", ids[i], i)
	}
	time.Sleep(60 * time.Second)
	if ctl.FailedCallbacks() < n {
		t.Fatalf("only %d callback attempts failed during the outage; the rollouts did not reach delivery", ctl.FailedCallbacks())
	}
	ctl.SetDown(false)
	checkDelivered(t, ctl, ids, 60*time.Second, srv.Output)
}

// serveUntilEnd runs serve (a trainer's) until the test ends.
func serveUntilEnd(t *testing.T, serve func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// startG1Controller runs a G1 trainer until the test ends.
func startG1Controller(t *testing.T, o controller.Options) *controller.Controller {
	t.Helper()
	ctl, err := controller.New("127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)
	return ctl
}

// startController runs a G2 trainer until the test ends.
func startController(t *testing.T, o controller.G2Options) *controller.G2 {
	t.Helper()
	ctl, err := controller.NewG2("127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)
	return ctl
}

// TestSplitDeliveryUnderFaults runs 2,000 G2 rollouts through a split
// deployment while the grader is SIGKILLed twice and half of all callback
// attempts answer 503: every rollout's completion and grader callback is
// accepted exactly once, every reward right.
func TestSplitDeliveryUnderFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("2,000 rollouts")
	}
	mockAddr := startMockPolicy(t)
	ctl := startController(t, controller.G2Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: controllerKey, FailFraction: 0.5, Logger: quietLog()})

	stateDir := t.TempDir()
	graderArgs := func(addr string) []string {
		return []string{"grader", "--grpc-addr", addr, "--metrics-addr", "", "--grader", "multiply", "--state", stateDir, "--log-level", "error"}
	}
	grader, addrs := startListening(t, "grader-1", nil, graderArgs("127.0.0.1:0")...)
	graderAddr := addrs["grpc"]
	waitGRPC(t, grader, graderAddr)
	roll, addrs := startListening(t, "rollout", nil, "rollout", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--grader-addr", graderAddr,
		"--workflow", "multiply", "--max-concurrent", "64", "--max-queued", "4000", "--log-level", "error")
	rolloutAddr := addrs["grpc"]
	waitGRPC(t, roll, rolloutAddr)
	gw, addrs := startListening(t, "gateway", nil, "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", rolloutAddr, "--grader-addr", graderAddr, "--log-level", "error")
	base := addrs["http"]
	waitHTTP(t, gw, base+"/health")

	const n = 2000
	ids := make([]string, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range ids {
		ids[i] = fmt.Sprintf("faults-%04d", i)
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			g2Start(t, ctl, base, "", ids[i], i)
		}()
		// The grader dies twice while rollouts are being graded.
		if i == n/4 || i == 3*n/4 {
			grader.Stop(syscall.SIGKILL, time.Second)
			time.Sleep(500 * time.Millisecond)
			// Each new grader takes the first one's address.
			grader = start(t, fmt.Sprintf("grader-%d", i), nil, graderArgs(graderAddr)...)
			waitGRPC(t, grader, graderAddr)
		}
	}
	wg.Wait()
	checkDelivered(t, ctl, ids, 5*time.Minute, roll.Output)
	if f := ctl.FailedCallbacks(); f < n/2 {
		t.Errorf("only %d callback attempts failed, want about half of them", f)
	}
}

// g1Init posts a G1 multiply rollout to base, labelled as g2Start labels.
func g1Init(t *testing.T, ctl *controller.Controller, base, id string, i int) {
	t.Helper()
	a, b := 3+i%17, 4+i%13
	truth := a * b
	if i%2 == 1 {
		truth++
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code, body, err := ctl.Init(ctx, base, "", controller.InitRequest{
		RolloutID:        id,
		Messages:         []map[string]any{{"role": "user", "content": fmt.Sprintf("What is %d times %d?", a, b)}},
		CompletionParams: map[string]any{"temperature": 0.7},
		Metadata:         map[string]any{"ground_truth": fmt.Sprint(truth)},
	})
	if err != nil || code != 202 {
		t.Fatalf("init %s: %d %s %v", id, code, body, err)
	}
}

// TestStateSurvivesSIGKILL: `osmo serve --state DIR` is SIGKILLed with
// rollouts queued and running and results not yet delivered (the trainer's
// callback endpoints are down), then restarted on the same state: every
// accepted G2 rollout gets exactly one completion and one grader callback,
// every G1 one exactly one completion,
// the finished ones with their rewards, the others a failure saying they
// were interrupted by the restart; a trainer's resubmission is not rerun.
func TestStateSurvivesSIGKILL(t *testing.T) {
	mockAddr := startMockPolicy(t, "--latency", "300ms")
	ctl := startController(t, controller.G2Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: controllerKey, Logger: quietLog()})
	g1 := startG1Controller(t, controller.Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: controllerKey, Logger: quietLog()})
	state := t.TempDir()
	args := []string{"serve", "--workflow", "multiply", "--grader", "multiply", "-p", "0", "-H", "127.0.0.1",
		"--max-concurrent", "4", "--max-queued", "100", "--state", state, "--log-level", "warn"}
	srv, addrs := startListening(t, "serve-1", nil, args...)
	base := addrs["http"]
	args = samePort(t, args, base)
	waitHTTP(t, srv, base+"/health")

	ctl.SetDown(true)
	g1.SetDown(true)
	const n = 40
	ids := make([]string, n)
	g1IDs := make([]string, n/4)
	for i := range ids {
		ids[i] = fmt.Sprintf("kill-%02d", i)
		g2Start(t, ctl, base, "", ids[i], i)
		if i < len(g1IDs) {
			g1IDs[i] = fmt.Sprintf("kill-g1-%02d", i)
			g1Init(t, g1, base, g1IDs[i], i)
		}
	}
	// Some results owed (their callbacks failing), most rollouts still
	// queued or running.
	for deadline := time.Now().Add(30 * time.Second); ctl.FailedCallbacks() < 6; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no results reached delivery in 30s\n%s", tail(srv.Output(), 4000))
		}
	}
	srv.Stop(syscall.SIGKILL, time.Second)
	ctl.SetDown(false)
	g1.SetDown(false)

	srv = start(t, "serve-2", nil, args...)
	waitHTTP(t, srv, base+"/health")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var graded, interrupted int
	for i, id := range ids {
		c, err := ctl.WaitCompletion(ctx, id)
		if err != nil {
			t.Fatalf("%s: %v\nserver output (tail):\n%s", id, err, tail(srv.Output(), 4000))
		}
		g, err := ctl.WaitGrader(ctx, id)
		if err != nil {
			t.Fatalf("%s: %v\nserver output (tail):\n%s", id, err, tail(srv.Output(), 4000))
		}
		switch {
		case g.Status == "success":
			want := float64(1 - i%2)
			if s, ok := g.Samples["multiply-agent"]; c.Status != "success" || !ok || s.Reward == nil || *s.Reward != want {
				t.Errorf("%s: completion %s, grader callback %s; want success with reward %v", id, c.Raw, g.Raw, want)
			}
			graded++
		case g.ErrCategory != nil && *g.ErrCategory == "agent_error" && g.ErrMessage != nil && strings.Contains(*g.ErrMessage, "interrupted by a restart"):
			interrupted++
		default:
			t.Errorf("%s: completion %s, grader callback %s; want a result or an interruption by the restart", id, c.Raw, g.Raw)
		}
	}
	for i, id := range g1IDs {
		c, err := g1.Wait(ctx, id)
		if err != nil {
			t.Fatalf("%s: %v\nserver output (tail):\n%s", id, err, tail(srv.Output(), 4000))
		}
		switch {
		case c.Status == "COMPLETED":
			if want := float64(1 - i%2); c.Reward == nil || *c.Reward != want {
				t.Errorf("%s: completion %s, want reward %v", id, c.Raw, want)
			}
			graded++
		case c.Status == "ERROR" && strings.Contains(c.ErrorMessage, "interrupted by a restart"):
			interrupted++
		default:
			t.Errorf("%s: completion %s, want a result or an interruption by the restart", id, c.Raw)
		}
	}
	if graded == 0 || interrupted == 0 {
		t.Errorf("%d results redelivered and %d rollouts interrupted; the kill should have left some of each", graded, interrupted)
	}
	// A trainer resubmitting after the restart is answered from the state.
	g2Start(t, ctl, base, "", ids[0], 0)
	g2Start(t, ctl, base, "", ids[n-1], n-1)
	g1Init(t, g1, base, g1IDs[0], 0)
	time.Sleep(time.Second) // a duplicate would have come by now
	for _, id := range ids {
		if c, g := len(ctl.Completions(id)), len(ctl.GraderCallbacks(id)); c != 1 || g != 1 {
			t.Errorf("%s: %d completions and %d grader callbacks, want exactly one each", id, c, g)
		}
	}
	for _, id := range g1IDs {
		if c := len(g1.Completions(id)); c != 1 {
			t.Errorf("%s: %d completions, want exactly one", id, c)
		}
	}
	t.Logf("after SIGKILL: %d results redelivered, %d rollouts reported interrupted", graded, interrupted)
}
