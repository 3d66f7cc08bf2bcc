//go:build unix

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// trainerStep is a line of the Python trainer's steps.jsonl.
type trainerStep struct {
	Step               int                `json:"step"`
	Rows               []string           `json:"rows"`
	TrainedRows        int                `json:"trained_rows"`
	Width              int                `json:"width"`
	Lengths            []int              `json:"lengths"`
	LossTokens         int                `json:"loss_tokens"`
	GroupAdvantageSums map[string]float64 `json:"group_advantage_sums"`
	Advantages         map[string]float64 `json:"advantages"`
	Cursor             string             `json:"cursor"`
}

func readTrainerSteps(t *testing.T, dir string) []trainerStep {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, "steps.jsonl"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []trainerStep
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		var s trainerStep
		if err := json.Unmarshal(sc.Bytes(), &s); err != nil {
			// A line being written: the next read has it whole.
			break
		}
		out = append(out, s)
	}
	return out
}

// TestPythonTrainerStreamsRows: examples/python-trainer streams the rows
// of the rollouts `osmo serve` finishes, is killed (SIGKILL) after its
// first steps, misses the rollouts that finish while it is down, and,
// restarted, resumes from its committed cursor: every row of every rollout
// is in exactly one committed step, and each step's tensors have the
// server's rows' lengths and masks, and advantages that sum to 0 per group.
func TestPythonTrainerStreamsRows(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is not on PATH; the trainer needs Python 3.11 or later: %v", err)
	}
	script, err := filepath.Abs("../examples/python-trainer/trainer.py")
	if err != nil {
		t.Fatal(err)
	}
	mockAddr := startMockPolicy(t)
	srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", "multiply", "--api-key", serverKey,
		"-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")
	ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
		PolicyURL: "http://" + mockAddr + "/v1", CallbackKey: "K-callbacks", CallbackTimeout: 60 * time.Second, Logger: quietLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)

	// A prompt's rollouts run together, two right and two wrong: the
	// trainer's group (--group-pattern) with rewards 1, 0, 1, 0.
	const prompts, perPrompt = 4, 4
	var ids []string
	runPrompt := func(p int) {
		var wg sync.WaitGroup
		for k := range perPrompt {
			id := fmt.Sprintf("p%d-k%d", p, k)
			ids = append(ids, id)
			label := "42"
			if k%2 == 1 {
				label = "41"
			}
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
				defer cancel()
				res, err := ctl.Run(ctx, base, serverKey, controller.V03RunRequest{
					RolloutID: id, Label: &label, Messages: []map[string]any{{"role": "user", "content": "What is 6 times 7?"}},
				})
				if err != nil || res.Status != "success" {
					t.Errorf("rollout %s: %+v %v", id, res, err)
				}
			})
		}
		wg.Wait()
	}

	state := t.TempDir()
	args := []string{script, "--url", base, "--state", state, "--batch-rows", "64", "--idle", "0.3", "--group-pattern", `^(.*)-k[0-9]+$`}
	env := []string{"OSMO_API_KEY=" + serverKey, "PYTHONDONTWRITEBYTECODE=1"}
	trainer := startBin(t, "trainer", py, env, args...)
	committed := func() int {
		n := 0
		for _, s := range readTrainerSteps(t, state) {
			n += len(s.Rows)
		}
		return n
	}
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 60s\ntrainer:\n%s\nserver:\n%s", what, trainer.Output(), tail(srv.Output(), 4000))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// A step per prompt: the next prompt runs once the trainer committed
	// the last one's rows (its idle closed the step).
	for p := range 2 {
		runPrompt(p)
		waitFor(fmt.Sprintf("the step of prompt %d", p), func() bool { return len(readTrainerSteps(t, state)) >= p+1 })
	}
	trainer.Stop(syscall.SIGKILL, 0)
	for p := 2; p < prompts; p++ {
		runPrompt(p)
	}

	// The server's own rows of every rollout.
	type serverRow struct {
		RolloutID string  `json:"rollout_id"`
		SampleID  string  `json:"sample_id"`
		Row       int     `json:"row"`
		TokenIDs  []int32 `json:"token_ids"`
		LossMask  []int32 `json:"loss_mask"`
	}
	want := map[string]serverRow{}
	var wantKeys []string
	for _, id := range ids {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, base+"/v1/rollouts/"+id+"/rows", nil)
		req.Header.Set("Authorization", "Bearer "+serverKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct {
			Rows []serverRow `json:"rows"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || len(body.Rows) == 0 {
			t.Fatalf("GET %s/rows: %d, %d rows, %v", id, resp.StatusCode, len(body.Rows), err)
		}
		for _, r := range body.Rows {
			k := fmt.Sprintf("%s/%s/%d", r.RolloutID, r.SampleID, r.Row)
			want[k] = r
			wantKeys = append(wantKeys, k)
		}
	}

	trainer = startBin(t, "trainer", py, env, args...)
	waitFor("every row committed", func() bool { return committed() >= len(wantKeys) })
	trainer.Stop(syscall.SIGTERM, 5*time.Second)
	if !strings.Contains(trainer.Output(), "resuming after step") {
		t.Errorf("the restarted trainer did not resume:\n%s", trainer.Output())
	}

	steps := readTrainerSteps(t, state)
	var got []string
	mixed := 0
	for i, s := range steps {
		if s.Step != i {
			t.Errorf("step %d is numbered %d", i, s.Step)
		}
		got = append(got, s.Rows...)
		if len(s.Lengths) != len(s.Rows) || s.TrainedRows != len(s.Rows) {
			t.Errorf("step %d: %d rows, %d trained, %d lengths", i, len(s.Rows), s.TrainedRows, len(s.Lengths))
			continue
		}
		loss, width := 0, 0
		for j, k := range s.Rows {
			r := want[k]
			width = max(width, len(r.TokenIDs))
			if s.Lengths[j] != len(r.TokenIDs) || len(r.LossMask) != len(r.TokenIDs) {
				t.Errorf("step %d row %s: length %d, the server's row has %d tokens", i, k, s.Lengths[j], len(r.TokenIDs))
			}
			for _, m := range r.LossMask {
				loss += int(m)
			}
		}
		if s.LossTokens != loss || s.Width != width {
			t.Errorf("step %d: %d loss tokens, width %d; the server's rows have %d and %d", i, s.LossTokens, s.Width, loss, width)
		}
		for g, sum := range s.GroupAdvantageSums {
			if math.Abs(sum) > 1e-6 {
				t.Errorf("step %d group %s: advantages sum to %g", i, g, sum)
			}
		}
		for _, a := range s.Advantages {
			if math.Abs(a) > 0.5 {
				mixed++
				break
			}
		}
	}
	slices.Sort(got)
	slices.Sort(wantKeys)
	if !slices.Equal(got, wantKeys) {
		t.Errorf("committed rows (%d) are not the server's rows (%d) each once:\ngot  %v\nwant %v", len(got), len(wantKeys), got, wantKeys)
	}
	if mixed == 0 {
		t.Errorf("no step had a group with both rewards: %+v", steps)
	}
}

// TestPythonTrainerAcrossAReplicaKill: two `osmo serve` replicas share one
// NATS server; the trainer streams from the first (--url first,second),
// which is killed (SIGKILL) once the trainer has committed a step. The
// trainer resumes on the second from its committed cursor, and ends with
// every row of every rollout, those finished on either replica, in
// exactly one committed step.
func TestPythonTrainerAcrossAReplicaKill(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is not on PATH; the trainer needs Python 3.11 or later: %v", err)
	}
	script, err := filepath.Abs("../examples/python-trainer/trainer.py")
	if err != nil {
		t.Fatal(err)
	}
	nats := startNATSCluster(t, 1)
	mockAddr := startMockPolicy(t)
	var bases []string
	var procs []*proc
	for _, name := range []string{"serve-a", "serve-b"} {
		srv, addrs := startListening(t, name, nil, "serve", "--workflow", "multiply", "--api-key", serverKey, "--nats", nats.URL(),
			"-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
		waitHTTP(t, srv, addrs["http"]+"/health")
		bases, procs = append(bases, addrs["http"]), append(procs, srv)
	}
	ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
		PolicyURL: "http://" + mockAddr + "/v1", CallbackKey: "K-callbacks", CallbackTimeout: 60 * time.Second, Logger: quietLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)
	var ids []string
	run := func(base string, from, n int) {
		var wg sync.WaitGroup
		for i := from; i < from+n; i++ {
			id := fmt.Sprintf("ro-%d", i)
			ids = append(ids, id)
			label := "42"
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
				defer cancel()
				res, err := ctl.Run(ctx, base, serverKey, controller.V03RunRequest{
					RolloutID: id, Label: &label, Messages: []map[string]any{{"role": "user", "content": "What is 6 times 7?"}},
				})
				if err != nil || res.Status != "success" {
					t.Errorf("rollout %s: %+v %v", id, res, err)
				}
			})
		}
		wg.Wait()
	}

	state := t.TempDir()
	trainer := startBin(t, "trainer", py, []string{"OSMO_API_KEY=" + serverKey, "PYTHONDONTWRITEBYTECODE=1"},
		script, "--url", bases[0]+","+bases[1], "--state", state, "--batch-rows", "4", "--idle", "0.3", "--give-up", "60")
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 60s\ntrainer:\n%s", what, trainer.Output())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	run(bases[0], 0, 6)
	waitFor("a first step", func() bool { return len(readTrainerSteps(t, state)) >= 1 })
	procs[0].Stop(syscall.SIGKILL, 0)
	run(bases[1], 6, 6)

	var wantKeys []string
	for _, id := range ids {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, bases[1]+"/v1/rollouts/"+id+"/rows", nil)
		req.Header.Set("Authorization", "Bearer "+serverKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct {
			Rows []struct {
				RolloutID string `json:"rollout_id"`
				SampleID  string `json:"sample_id"`
				Row       int    `json:"row"`
			} `json:"rows"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || len(body.Rows) == 0 {
			t.Fatalf("GET %s/rows: %d, %d rows, %v", id, resp.StatusCode, len(body.Rows), err)
		}
		for _, r := range body.Rows {
			wantKeys = append(wantKeys, fmt.Sprintf("%s/%s/%d", r.RolloutID, r.SampleID, r.Row))
		}
	}
	var got []string
	waitFor("every row committed", func() bool {
		got = got[:0]
		for _, s := range readTrainerSteps(t, state) {
			got = append(got, s.Rows...)
		}
		return len(got) >= len(wantKeys)
	})
	trainer.Stop(syscall.SIGTERM, 5*time.Second)
	if !strings.Contains(trainer.Output(), "resuming after") {
		t.Errorf("the trainer did not say it resumed on the other replica:\n%s", trainer.Output())
	}
	slices.Sort(got)
	slices.Sort(wantKeys)
	if !slices.Equal(got, wantKeys) {
		t.Errorf("committed rows (%d) are not the rows of every rollout (%d) each once:\ngot  %v\nwant %v", len(got), len(wantKeys), got, wantKeys)
	}
}
