//go:build unix

package e2e

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// engineFaults are the ways one engine of a fleet misbehaves, as `osmo
// mockllm` flags: it dies mid-run, hangs on some calls, answers 5xx to
// some, or dies and comes back on its port.
var engineFaults = []struct {
	name string
	args []string
}{
	{"killed", []string{"--die-after", "6"}},
	{"hangs", []string{"--fail-mode", "hang", "--fail-fraction", "0.3", "--fail-seed", "1"}},
	{"5xx", []string{"--fail-mode", "503", "--fail-fraction", "0.3", "--fail-seed", "2"}},
	{"comes-back", []string{"--die-after", "6", "--down-for", "2s"}},
}

// startEngines runs n `osmo mockllm` engines named e0…, engine i with
// extra[i] added, and returns their base URLs (ending in /v1).
func startEngines(t *testing.T, n int, extra map[int][]string) []string {
	t.Helper()
	urls := make([]string, n)
	for i := range n {
		args := append([]string{"--engine-id", fmt.Sprintf("e%d", i)}, extra[i]...)
		urls[i] = "http://" + startMockPolicy(t, args...) + "/v1"
	}
	return urls
}

// TestPlaneEngineFaults runs rollouts under `osmo serve` in front of three
// engines (the plane routing every call), one of which misbehaves. Every
// rollout ends with exactly one completion and one grader callback, as a
// success with both turns answered once, or as a failure with an error
// category: nothing lost, nothing answered twice.
func TestPlaneEngineFaults(t *testing.T) {
	for _, f := range engineFaults {
		t.Run(f.name, func(t *testing.T) {
			engines := startEngines(t, 3, map[int][]string{0: f.args})
			// A hung call moves once its engine's attempt timeout ends.
			args := []string{"--workflow", "multiply", "--grader", "multiply", "--policy-owns-routing", "--policy-timeout", "3s"}
			for _, u := range engines {
				args = append(args, "--policy", u)
			}
			s := startG2(t, nil, nil, args...)
			outcomes := runFaultRollouts(t, s, "plane-"+f.name, 24)
			// With two healthy engines the plane fails over: nothing fails.
			if outcomes["failure"] > 0 {
				t.Errorf("%d of 24 rollouts failed with two healthy engines left (%v)", outcomes["failure"], outcomes)
			}
		})
	}
}

// TestEngineFaultsSingleUpstream is the same faults with the one engine
// the trainer names (no plane): the proxy's retries carry the 5xx and the
// engine that comes back; a dead engine fails its rollouts with a
// category, never leaves them hanging or answers a call twice.
func TestEngineFaultsSingleUpstream(t *testing.T) {
	for _, f := range engineFaults {
		if f.name == "hangs" {
			// A hung call is bounded by the agent's timeout alone with one
			// engine; the plane's failover is what TestPlaneEngineFaults
			// checks.
			continue
		}
		args := f.args
		if f.name == "5xx" {
			// One engine: a call fails only when every retry drew a 503,
			// which at 20% is rare enough to bound.
			args = []string{"--fail-mode", "503", "--fail-fraction", "0.2", "--fail-seed", "2"}
		}
		t.Run(f.name, func(t *testing.T) {
			s := startG2(t, append([]string{"--engine-id", "e0"}, args...), nil, "--workflow", "multiply", "--grader", "multiply")
			outcomes := runFaultRollouts(t, s, "single-"+f.name, 12)
			// Without the proxy's retries 4 in 10 would fail.
			if f.name == "5xx" && outcomes["failure"] > 2 {
				t.Errorf("%d rollouts failed on 503s the proxy retries (%v)", outcomes["failure"], outcomes)
			}
		})
	}
}

// runFaultRollouts starts n multiply rollouts at once and checks each one
// ends once, whole or failed with a category; it returns the counts of
// each status.
func runFaultRollouts(t *testing.T, s *g2Stack, prefix string, n int) map[string]int {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		if code, data := s.startRollout(t, ids[i], faultPrompt, faultLabel, map[string]any{"agent_timeout_sec": 60}); code != 202 {
			t.Fatalf("%s: POST /rollout = %d %s", ids[i], code, data)
		}
	}
	var (
		mu       sync.Mutex
		outcomes = map[string]int{}
		wg       sync.WaitGroup
	)
	for _, id := range ids {
		wg.Go(func() {
			comp, grade := s.callbacks(t, id)
			mu.Lock()
			outcomes[comp.Status]++
			mu.Unlock()
			checkOneOutcome(t, id, comp, grade)
		})
	}
	wg.Wait()
	time.Sleep(200 * time.Millisecond) // strays would arrive by now
	for _, id := range ids {
		if c, g := len(s.ctl.Completions(id)), len(s.ctl.GraderCallbacks(id)); c != 1 || g != 1 {
			t.Errorf("%s: %d completion and %d grader callbacks, want exactly 1 each", id, c, g)
		}
	}
	t.Logf("%s: %v", prefix, outcomes)
	return outcomes
}

// checkOneOutcome: a success answered each of its two turns once; a
// failure says why.
func checkOneOutcome(t *testing.T, id string, comp, grade controller.G2Callback) {
	t.Helper()
	switch comp.Status {
	case "success":
		sample, ok := grade.Samples["multiply-agent"]
		if !ok {
			t.Errorf("%s: grader callback %s has no sample", id, grade.Raw)
			return
		}
		roles := make([]string, 0, len(sample.Messages))
		for _, m := range sample.Messages {
			roles = append(roles, fmt.Sprint(m["role"]))
		}
		if got := strings.Join(roles, ","); got != "system,user,assistant,tool,assistant" || len(sample.LLMCalls) != 2 {
			t.Errorf("%s: roles %s and %d llm_calls, want each turn answered once (system,user,assistant,tool,assistant; 2 calls)", id, got, len(sample.LLMCalls))
		}
	case "failure":
		if comp.ErrCategory == nil || *comp.ErrCategory == "" || comp.ErrMessage == nil {
			t.Errorf("%s: failure without a category and message: %s", id, comp.Raw)
		}
	default:
		t.Errorf("%s: completion status %q: %s", id, comp.Status, comp.Raw)
	}
}
