//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// postPlane posts body to url and returns the status and the answer.
func postPlane(t *testing.T, url string, body any) (int, string) {
	t.Helper()
	b, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(string(b)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}

// enginePaused reads an engine's GET /is_paused.
func enginePaused(t *testing.T, engine string) bool {
	t.Helper()
	resp, err := httpClient.Get(strings.TrimSuffix(engine, "/v1") + "/is_paused")
	if err != nil {
		t.Fatalf("is_paused of %s: %v", engine, err)
	}
	defer resp.Body.Close()
	var out struct {
		IsPaused bool `json:"is_paused"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("is_paused of %s: %v", engine, err)
	}
	return out.IsPaused
}

// TestPlanePauseAcrossCluster pauses and resumes the policy through the
// gateway of a three-replica cluster in each mode while rollouts run on
// three engines: the pause reaches every engine, the resume releases
// them, every rollout ends exactly once (none lost to an abort), and each
// recorded call carries the version in force when it was answered. Bad
// pauses and resumes get their status.
func TestPlanePauseAcrossCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a three-replica cluster through three pauses")
	}
	engines := startEngines(t, 3, map[int][]string{0: {"--latency", "300ms"}, 1: {"--latency", "300ms"}, 2: {"--latency", "300ms"}})
	policy := "http://" + startMockPolicy(t) + "/v1"
	ctl := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})
	args := []string{"--policy-owns-routing"}
	for _, e := range engines {
		args = append(args, "--policy", e)
	}
	c := startReplicas(t, replicaOptions{n: 3, args: args})
	if code, body := postPlane(t, c.gateway+"/v1/policy/resume", map[string]any{"version": 1}); code != http.StatusConflict {
		t.Errorf("a resume without a pause: %d %s, want 409", code, body)
	}
	if code, body := postPlane(t, c.gateway+"/v1/policy/pause", map[string]any{"mode": "sleep"}); code != http.StatusUnprocessableEntity || !strings.Contains(body, "mode") {
		t.Errorf("a pause with an unknown mode: %d %s, want 422 naming mode", code, body)
	}

	d := &clusterDriver{g2: ctl}
	version := 0
	for round, mode := range []string{"keep", "wait", "abort"} {
		const n = 9
		ids := make([]string, n)
		for i := range ids {
			it := newClusterItem(100*round + i)
			it.id = fmt.Sprintf("pause-%s-%d", mode, i)
			ids[i] = it.id
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			code, _, data, err := ctl.Start(ctx, c.gateway, "", d.g2Body(it))
			cancel()
			if err != nil || code != http.StatusAccepted {
				t.Fatalf("start %s: %d %s %v", it.id, code, data, err)
			}
		}
		waitFor(t, "rollouts running", func() bool {
			running := 0.0
			for _, r := range c.replicas {
				running += max(r.gauge("osmo_rollouts_running"), 0)
			}
			return running > 0
		})
		if code, body := postPlane(t, c.gateway+"/v1/policy/pause", map[string]any{"mode": mode}); code != http.StatusOK {
			t.Fatalf("pause %s: %d %s", mode, code, body)
		}
		for _, e := range engines {
			if !enginePaused(t, e) {
				t.Errorf("pause %s answered before engine %s was paused", mode, e)
			}
		}
		version++
		if code, body := postPlane(t, c.gateway+"/v1/policy/resume", map[string]any{"version": version}); code != http.StatusOK {
			t.Fatalf("resume to %d: %d %s", version, code, body)
		}
		if code, body := postPlane(t, c.gateway+"/v1/policy/resume", map[string]any{"version": version}); code != http.StatusOK {
			t.Errorf("the same resume repeated: %d %s, want 200", code, body)
		}
		if code, body := postPlane(t, c.gateway+"/v1/policy/resume", map[string]any{"version": version - 1}); code != http.StatusConflict {
			t.Errorf("a resume to a lower version: %d %s, want 409", code, body)
		}
		for _, e := range engines {
			if enginePaused(t, e) {
				t.Errorf("engine %s still paused after the resume", e)
			}
		}
		checkPausedRollouts(t, ctl, c.gateway, ids, version)
	}
}

// checkPausedRollouts: each rollout ended once; a success's recorded calls
// (its record, GET /v1/rollouts/{id}: the wire's callbacks carry only the
// Osmosis fields) carry a version no later than the current one.
func checkPausedRollouts(t *testing.T, ctl *controller.G2, gateway string, ids []string, current int) {
	t.Helper()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			comp, err := ctl.WaitCompletion(ctx, id)
			if err != nil {
				t.Errorf("%s: no completion: %v", id, err)
				return
			}
			if comp.Status != "success" {
				// Nothing is lost to a pause: an aborted call is sent again.
				t.Errorf("%s: %s", id, comp.Raw)
				return
			}
			if _, err := ctl.WaitGrader(ctx, id); err != nil {
				t.Errorf("%s: no grader callback: %v", id, err)
				return
			}
			var rec struct {
				State   string `json:"state"`
				Samples []struct {
					ID       string                       `json:"id"`
					LLMCalls []map[string]json.RawMessage `json:"llm_calls"`
				} `json:"samples"`
			}
			for rec.State != "STATE_SUCCEEDED" {
				if ctx.Err() != nil {
					t.Errorf("%s: record state %q", id, rec.State)
					return
				}
				resp, err := httpClient.Get(gateway + "/v1/rollouts/" + id)
				if err == nil {
					err = json.NewDecoder(resp.Body).Decode(&rec)
					resp.Body.Close()
				}
				if err != nil {
					t.Errorf("%s: record: %v", id, err)
					return
				}
				if rec.State != "STATE_SUCCEEDED" {
					time.Sleep(50 * time.Millisecond)
				}
			}
			for _, sm := range rec.Samples {
				for i, call := range sm.LLMCalls {
					var v int
					if err := json.Unmarshal(call["policy_version"], &v); err != nil || v < 0 || v > current {
						t.Errorf("%s: sample %s call %d policy_version %s, want a JSON integer in [0, %d]", id, sm.ID, i, call["policy_version"], current)
					}
				}
			}
		})
	}
	wg.Wait()
	time.Sleep(200 * time.Millisecond) // strays would arrive by now
	for _, id := range ids {
		if c, g := len(ctl.Completions(id)), len(ctl.GraderCallbacks(id)); c != 1 || g != 1 {
			t.Errorf("%s: %d completion and %d grader callbacks, want exactly 1 each", id, c, g)
		}
	}
}
