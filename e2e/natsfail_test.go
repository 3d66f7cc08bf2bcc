//go:build unix

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestNATSUnreachableAtStart: a service given a NATS URL nothing answers
// at exits non-zero, soon, with an error naming the URL.
func TestNATSUnreachableAtStart(t *testing.T) {
	url := "nats://" + refusedAddr
	for _, args := range [][]string{
		{"rollout", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--grader", "none", "--workflow", "calculator", "--nats", url},
		{"grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--nats", url},
	} {
		t.Run(args[0], func(t *testing.T) {
			began := time.Now()
			p := start(t, args[0], nil, args...)
			select {
			case <-p.Done():
			case <-time.After(15 * time.Second):
				t.Fatalf("osmo %s still running 15s after start with NATS unreachable:\n%s", args[0], p.Output())
			}
			if code := p.ExitCode(); code == 0 {
				t.Errorf("osmo %s exited 0 with NATS unreachable", args[0])
			}
			if out := p.Output(); !strings.Contains(out, url) {
				t.Errorf("osmo %s's error does not name %s:\n%s", args[0], url, out)
			}
			t.Logf("exited in %v", time.Since(began).Round(time.Millisecond))
		})
	}
}

// TestNATSLostWhileServing: the one NATS server of a deployment is
// SIGKILLed while rollouts are queued and running. New admissions answer
// 503 through the gateway within seconds (not 500, not a hang) and the
// services stay up; once the server is back on its store every rollout
// accepted before gets its callbacks, exactly once, with its reward, and
// admissions are taken again.
func TestNATSLostWhileServing(t *testing.T) {
	nc := startNATSCluster(t, 1)
	policy := "http://" + startMockPolicy(t, "--latency", "150ms") + "/v1"
	g2 := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})
	g1 := startG1Controller(t, controller.Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})

	grader, addrs := startListening(t, "grader", nil, "grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--grader", "calculator",
		"--nats", nc.URL(), "--log-level", "warn")
	graderAddr := addrs["grpc"]
	waitGRPC(t, grader, graderAddr)
	roll, addrs := startListening(t, "rollout", nil, "rollout", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--grader-addr", graderAddr,
		"--workflow", "calculator", "--max-concurrent", "2", "--max-queued", "100", "--nats", nc.URL(), "--lost-after", "3s", "--log-level", "warn")
	rolloutAddr := addrs["grpc"]
	waitGRPC(t, roll, rolloutAddr)
	gw, addrs := startListening(t, "gateway", nil, "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", rolloutAddr, "--grader-addr", graderAddr, "--log-level", "warn")
	base := addrs["http"]
	waitHTTP(t, gw, base+"/health")

	// Accepted before the outage: more than the replica runs at once.
	d := &clusterDriver{g1: g1, g2: g2}
	var items []*clusterItem
	for i := range 10 {
		it := newClusterItem(i)
		it.id, it.wire = fmt.Sprintf("lost-%02d", i), wireG2
		if i%5 == 4 {
			it.wire = wireG1
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var code int
		var data []byte
		var err error
		if it.wire == wireG1 {
			code, data, err = g1.Init(ctx, base, "", d.g1Init(it))
		} else {
			code, _, data, err = g2.Start(ctx, base, "", d.g2Body(it))
		}
		cancel()
		if err != nil || code != http.StatusAccepted {
			t.Fatalf("start %s: %d %s %v\n%s", it.id, code, data, err, tail(roll.Output(), 4000))
		}
		it.accepted = true
		items = append(items, it)
	}
	// Some running (their LLM calls under way), the rest queued.
	waitFor(t, "the first LLM calls", func() bool { return len(g2.Chats())+len(g1.Chats()) >= 2 })
	nc.Kill(0)
	killed := time.Now()

	// New admissions, G2 and G1, at once: each answers 503 within seconds.
	type answer struct {
		what string
		code int
		took time.Duration
		err  error
	}
	answers := make(chan answer, 4)
	var wg sync.WaitGroup
	for k := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("outage-%d", k)
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			began := time.Now()
			var code int
			var err error
			if k == 3 {
				code, _, err = g1.Init(ctx, base, "", controller.InitRequest{RolloutID: id,
					Messages: []map[string]any{{"role": "user", "content": "What is 2 * 3?"}}, Metadata: map[string]any{"ground_truth": "6"}})
			} else {
				body := g2.StartBody(id, []map[string]any{{"role": "user", "content": "What is 2 * 3?"}})
				body["label"] = "6"
				code, _, _, err = g2.Start(ctx, base, "", body)
			}
			answers <- answer{id, code, time.Since(began), err}
		}()
	}
	wg.Wait()
	close(answers)
	var refused []string
	for a := range answers {
		if a.err == nil && a.code == http.StatusServiceUnavailable {
			refused = append(refused, a.what)
		}
		switch {
		case a.err != nil:
			t.Errorf("admission of %s during the outage: no answer after %v: %v", a.what, a.took, a.err)
		case a.code != http.StatusServiceUnavailable:
			t.Errorf("admission of %s during the outage: %d after %v, want 503", a.what, a.code, a.took)
		case a.took > 8*time.Second:
			t.Errorf("admission of %s during the outage: 503 only after %v, want within seconds", a.what, a.took)
		}
	}
	for _, p := range []*proc{roll, grader, gw} {
		if p.Exited() {
			t.Fatalf("%s exited when NATS was lost:\n%s", p.Name, tail(p.Output(), 4000))
		}
	}
	t.Logf("NATS down for %v", time.Since(killed).Round(time.Millisecond))
	nc.Restart(0)

	// Admissions are taken again (after 503s while the services reconnect).
	again := "after-outage"
	body := g2.StartBody(again, []map[string]any{{"role": "user", "content": "What is 6 * 7?"}})
	body["label"] = "42"
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		code, _, data, err := g2.Start(ctx, base, "", body)
		cancel()
		if err == nil && code == http.StatusAccepted {
			break
		}
		if time.Now().After(deadline) || (err == nil && code != http.StatusServiceUnavailable) {
			t.Fatalf("admission after NATS came back: %d %s %v\n%s", code, data, err, tail(roll.Output(), 4000))
		}
	}

	// Nothing accepted before is lost: each rollout's callbacks, once, with
	// its reward (the replica never went away, so none is a failure).
	items = append(items, &clusterItem{id: again, wire: wireG2, truth: "42", reward: 1, accepted: true})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	fails := &failures{}
	for _, it := range items {
		if !d.waitEnd(ctx, it) {
			continue
		}
		if it.failed {
			fails.add("a rollout accepted before the outage failed", "%s (%s): %s", it.id, it.wire, it.errMsg)
		}
	}
	time.Sleep(500 * time.Millisecond) // a duplicate would have come by now
	for _, it := range items {
		checkItemCallbacks(it, d, fails)
	}
	fails.report(t)
	if t.Failed() {
		t.Logf("rollout service output (tail):\n%s", tail(roll.Output(), 4000))
	}
	// The admissions answered 503 started nothing.
	for _, id := range refused {
		if len(g2.Completions(id))+len(g1.Completions(id)) != 0 {
			t.Errorf("%s was refused with 503 but ran", id)
		}
	}
}
