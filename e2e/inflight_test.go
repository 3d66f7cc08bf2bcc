//go:build unix

package e2e

import (
	"context"
	"fmt"
	"math"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/rolloutbench"
)

// inFlight is how many rollouts the tests below hold at once: the load a
// training step puts on one rollout server.
const inFlight = 10_000

// memLimit is the soft memory limit the server runs under, as the compose
// file and the manifests set it from the container's limit.
const memLimit = "GOMEMLIMIT=900MiB"

// TestTenThousandInFlight holds 10,000 G2 rollouts of `osmo serve` in their
// first LLM call at once: the server stays under 1 GiB of RSS and within
// its descriptors, and every rollout is graded once the policy answers.
func TestTenThousandInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("10,000 rollouts")
	}
	rep, err := rolloutbench.Measure(context.Background(), rolloutbench.Config{
		Serve: func(args []string) *exec.Cmd {
			cmd := exec.Command(osmoBin, append([]string{"serve"}, args...)...)
			cmd.Env = append(os.Environ(), memLimit)
			return cmd
		},
		Rollouts:    200,
		Concurrency: 32,
		InFlight:    inFlight,
		Timeout:     5 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	var table strings.Builder
	rep.WriteTable(&table)
	t.Log("\n" + table.String())
	if rep.Held.RSS >= 1<<30 {
		t.Errorf("RSS with %d rollouts in flight = %.0f MiB, want under 1 GiB", inFlight, rep.Held.RSS/(1<<20))
	}
	// One upstream connection per rollout and nothing else per rollout.
	if extra := rep.Held.FDs - rep.Base.FDs; extra > inFlight*11/10 {
		t.Errorf("%.0f more open files with %d rollouts in flight, want at most one each", extra, inFlight)
	}
	if !rep.AllGraded {
		t.Errorf("not every held rollout was graded once released: %s", rep.GradeErr)
	}
	// What a rollout costs the server, and its peak while the held ones
	// finish: measured, whatever their size.
	for name, v := range map[string]float64{"CPU per rollout": rep.CPU, "bytes allocated per rollout": rep.AllocBytes,
		"objects allocated per rollout": rep.Allocs, "peak RSS": rep.PeakRSS} {
		if !(v > 0) || math.IsInf(v, 0) {
			t.Errorf("%s = %v, want a positive finite figure", name, v)
		}
	}
	if rep.PeakRSS < rep.Held.RSS {
		t.Errorf("peak RSS %.0f MiB, below the RSS with the rollouts held (%.0f MiB)", rep.PeakRSS/(1<<20), rep.Held.RSS/(1<<20))
	}
	for _, col := range []string{"CPU/rollout", "alloc/rollout", "allocs/rollout", "peak RSS"} {
		if !strings.Contains(table.String(), col) {
			t.Errorf("the table has no %q", col)
		}
	}
}

// TestCancelAllInFlight holds 10,000 rollouts in an LLM call the policy
// never answers, then cancels them all with one POST /rollout/cancel
// {"all": true}: each gets exactly one cancelled completion, their upstream
// calls are aborted, and the server's goroutines and descriptors return to
// what they were before.
func TestCancelAllInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("10,000 rollouts")
	}
	mock, err := mockllm.New(mockllm.Options{Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	gate := rolloutbench.NewGate()
	gate.Close() // never opened: the policy hangs
	policy := httptest.NewServer(gate.Wrap(mock))
	t.Cleanup(policy.Close)
	t.Cleanup(gate.Open) // before Close, which waits for the held calls
	ctl := startController(t, controller.G2Options{PolicyURL: policy.URL + "/v1", APIKey: controllerKey, Logger: quietLog()})

	limit := strconv.Itoa(inFlight)
	srv, addrs := startListening(t, "serve", []string{memLimit, "OSMOSIS_ROLLOUT_CLIENT_MAX_CONNECTIONS=" + strconv.Itoa(inFlight+100)},
		"serve", "--workflow", "multiply", "-p", "0", "-H", "127.0.0.1", "--max-concurrent", limit, "--max-queued", limit, "--log-level", "error")
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	before, err := rolloutbench.Scrape(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, inFlight)
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(starts)
	for i := range ids {
		ids[i] = fmt.Sprintf("cancel-all-%05d", i)
		g.Go(func() error {
			body := ctl.StartBody(ids[i], []map[string]any{{"role": "user", "content": "What is 6 times 7?"}})
			body["chat_completions_url"] = policy.URL + "/v1" // straight to the policy: the relay would double the descriptors here
			body["label"] = "42"
			code, _, data, err := ctl.Start(gctx, base, "", body)
			if err == nil && code != 202 {
				err = fmt.Errorf("start %s: %d %s", ids[i], code, data)
			}
			return err
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	if err := gate.WaitParked(ctx, inFlight); err != nil {
		t.Fatalf("%v\nserver output (tail):\n%s", err, tail(srv.Output(), 4000))
	}
	held, err := rolloutbench.Scrape(ctx, base)
	if err != nil {
		t.Fatal(err)
	}

	code, _, resp := do(t, "POST", base+"/rollout/cancel", "", `{"all": true}`)
	if d, _ := resp["dispositions"].(map[string]any); code != 200 || len(d) != inFlight {
		t.Fatalf("cancel all = %d with %d dispositions, want 200 with %d", code, len(d), inFlight)
	}
	for _, id := range ids {
		c, err := ctl.WaitCompletion(ctx, id)
		if err != nil {
			t.Fatalf("%s: %v\nserver output (tail):\n%s", id, err, tail(srv.Output(), 4000))
		}
		if c.Status != "cancelled" {
			t.Fatalf("%s: completion %s, want cancelled", id, c.Raw)
		}
	}
	for deadline := time.Now().Add(20 * time.Second); gate.Parked() > 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d upstream calls still held after the cancel\nserver output (tail):\n%s", gate.Parked(), tail(srv.Output(), 4000))
		}
	}
	time.Sleep(500 * time.Millisecond) // a duplicate would have come by now
	for _, id := range ids {
		if n := len(ctl.Completions(id)); n != 1 {
			t.Errorf("%s: %d completions, want exactly 1", id, n)
		}
	}
	// What is left is what was there before, the keep-alive connections
	// to the trainer's callback endpoint (two goroutines and a descriptor
	// each), and the trainer's own to the server, one per start it made at
	// once (a goroutine and a descriptor each).
	var after rolloutbench.Sample
	settled := func() bool {
		after, err = rolloutbench.Scrape(ctx, base)
		return err == nil && after.Goroutines <= before.Goroutines+2*keepAlive+starts+20 && after.FDs <= before.FDs+keepAlive+starts+10
	}
	deadline := time.Now().Add(30 * time.Second)
	for !settled() && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if !settled() {
		t.Errorf("after cancelling every rollout: %.0f goroutines and %.0f open files, before any: %.0f and %.0f",
			after.Goroutines, after.FDs, before.Goroutines, before.FDs)
	}
	t.Logf("goroutines %.0f → %.0f in flight → %.0f after; open files %.0f → %.0f → %.0f",
		before.Goroutines, held.Goroutines, after.Goroutines, before.FDs, held.FDs, after.FDs)
}

// keepAlive is the rollout service's default idle connections per
// callback host (OSMOSIS_ROLLOUT_CLIENT_MAX_KEEPALIVE_CONNECTIONS).
const keepAlive = 100

// starts is how many starts the trainer posts at once.
const starts = 64
