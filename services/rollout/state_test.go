package rollout_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/services/rollout"
)

// stateFile is the state log's name in its directory.
const stateFile = "rollouts.wal"

// heldOrMultiply runs the multiply agent, except for rollouts whose id
// starts with "held-": those wait for their context to end.
func heldOrMultiply(t *testing.T, runs *sync.Map) *osmo.Workflow {
	return mustWorkflow(t, "held-or-multiply", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		n, _ := runs.LoadOrStore(wc.RolloutID, new(int))
		*n.(*int)++
		if strings.HasPrefix(wc.RolloutID, "held-") {
			<-ctx.Done()
			return ctx.Err()
		}
		msgs, err := runMultiplyAgent(ctx, wc.Rollout.Endpoint("s"), wc.Prompt)
		if err != nil {
			return err
		}
		return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]osmo.Message, error) { return msgs, nil }))
	})
}

// labelGrader grades as gradeLabelled does: 1 for an answer of 42 to a
// row labelled "forty-two".
func labelGrader() *fakeGrader {
	var mu sync.Mutex
	var reqs []*graderv1.GradeRequest
	return &fakeGrader{fn: gradeLabelled(&reqs, &mu)}
}

// waitLogged waits until the state log in dir holds every one of subs.
func waitLogged(t *testing.T, dir string, subs ...string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(dir, stateFile))
		missing := ""
		for _, s := range subs {
			if !bytes.Contains(b, []byte(s)) {
				missing = s
				break
			}
		}
		if missing == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the state log never held %s", missing)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stateConfig turns the state log on in dir; callbacks are retried for a
// minute, so that only the shutdown stops them.
func stateConfig(dir string, g rollout.Grader) func(*rollout.Config) {
	return func(c *rollout.Config) {
		c.StateDir = dir
		c.Grader = g
		c.Callbacks.Deadline = time.Minute
		c.RolloutTimeout = time.Minute
	}
}

// waitQuiet waits until the trainer has received no callback for a while:
// a duplicate would have come by then.
func waitQuiet(g2 *controller.G2, ids []string) {
	count := func() int {
		n := 0
		for _, id := range ids {
			n += len(g2.Completions(id)) + len(g2.GraderCallbacks(id))
		}
		return n
	}
	last := count()
	for quiet := time.Now(); time.Since(quiet) < 300*time.Millisecond; time.Sleep(20 * time.Millisecond) {
		if n := count(); n != last {
			last, quiet = n, time.Now()
		}
	}
}

// TestStateRecoversAfterCrash takes the state log of a running service as
// a crash would leave it (copied while rollouts run and their callbacks
// fail, with a torn entry at its end) and starts a new service on it: every
// accepted rollout ends with exactly one completion and one grader
// callback, those that had finished with their results (reward included),
// the one that was running as a failure saying it was interrupted by a
// restart; a resubmission of a known id is answered from the state, not
// rerun; and a third start, from what the second left, delivers nothing
// again and still knows every rollout.
func TestStateRecoversAfterCrash(t *testing.T) {
	g := labelGrader()
	var runs sync.Map
	wf := heldOrMultiply(t, &runs)
	dirA, dirB := t.TempDir(), t.TempDir()

	a := newHarness(t, harnessOpts{wf: wf, cfg: stateConfig(dirA, g)})
	a.g2.SetDown(true) // every callback answered 503: the results stay owed
	done := []string{"done-1", "done-2"}
	for _, id := range done {
		a.start(t, a.startReq(t, id))
	}
	a.start(t, a.startReq(t, "held-1"))
	// Both done rollouts graded (their grader callbacks are owed) and the
	// held one accepted: what a crash now must not lose.
	waitLogged(t, dirA, `"id":"done-1","stage":"final"`, `"id":"done-2","stage":"final"`, `"op":"accepted","id":"held-1"`)
	snapshot, err := os.ReadFile(filepath.Join(dirA, stateFile))
	if err != nil {
		t.Fatal(err)
	}
	// The entry being written when the process died, cut short.
	snapshot = append(snapshot, 0x40, 0, 0, 0, 1, 2, 3, 4, '{', '"', 'o')
	if err := os.WriteFile(filepath.Join(dirB, stateFile), snapshot, 0o600); err != nil {
		t.Fatal(err)
	}
	a.stop(t) // its callbacks never got through
	ids := append(done, "held-1")
	for _, id := range ids {
		if n := len(a.g2.Completions(id)) + len(a.g2.GraderCallbacks(id)); n != 0 {
			t.Fatalf("%s: %d callbacks delivered before the restart", id, n)
		}
	}

	a.g2.SetDown(false)
	var logs logtest.Buffer
	b := newHarness(t, harnessOpts{share: a, wf: wf, cfg: func(c *rollout.Config) {
		stateConfig(dirB, g)(c)
		c.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	}})
	if s := logs.String(); !strings.Contains(s, "dropped what follows the last whole entry") || !strings.Contains(s, `"bytes":11`) {
		t.Errorf("the torn entry was not reported:\n%s", s)
	}
	for _, id := range done {
		comp, gcb := b.waitCompletion(t, id), b.waitGrader(t, id)
		if comp.Status != "success" || gcb.Status != "success" {
			t.Errorf("%s: completion %s, grader callback %s; want both success", id, comp.Raw, gcb.Raw)
		}
		if s := gcb.Samples["s"]; s.Reward == nil || *s.Reward != 1 {
			t.Errorf("%s: grader callback %s, want sample s with reward 1", id, gcb.Raw)
		}
		if r := b.waitDone(t, id); r.GetReward() != 1 || r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
			t.Errorf("%s after the restart: state %v reward %v, want succeeded with reward 1", id, r.GetState(), r.Reward)
		}
	}
	comp, gcb := b.waitCompletion(t, "held-1"), b.waitGrader(t, "held-1")
	assertFailure(t, "completion", comp, "agent_error", "interrupted by a restart")
	assertFailure(t, "grader callback", gcb, "agent_error", "interrupted by a restart")
	waitQuiet(a.g2, ids)
	for _, id := range ids {
		if c, gc := len(a.g2.Completions(id)), len(a.g2.GraderCallbacks(id)); c != 1 || gc != 1 {
			t.Errorf("%s: %d completions and %d grader callbacks, want exactly one each", id, c, gc)
		}
	}

	// A trainer resubmitting a known rollout is answered, and nothing runs.
	b.start(t, b.startReq(t, "done-1"))
	b.start(t, b.startReq(t, "held-1"))
	for _, id := range ids {
		if n, _ := runs.Load(id); *n.(*int) != 1 {
			t.Errorf("%s ran %d times, want once", id, *n.(*int))
		}
	}
	if st := b.status(t, "held-1"); st.GetStatus() != "failure" || !strings.Contains(st.GetErrMessage(), "interrupted by a restart") {
		t.Errorf("status of held-1 = %v, want failure interrupted by a restart", st)
	}
	b.stop(t)

	c := newHarness(t, harnessOpts{share: a, wf: wf, cfg: stateConfig(dirB, g)})
	c.start(t, c.startReq(t, "done-2"))
	if st := c.status(t, "done-2"); st.GetStatus() != "success" || st.GetReward() != 1 {
		t.Errorf("status of done-2 after a second restart = %v, want success with reward 1", st)
	}
	waitQuiet(a.g2, ids)
	for _, id := range ids {
		if c, gc := len(a.g2.Completions(id)), len(a.g2.GraderCallbacks(id)); c != 1 || gc != 1 {
			t.Errorf("%s after a second restart: %d completions and %d grader callbacks, want one each", id, c, gc)
		}
		if n, _ := runs.Load(id); *n.(*int) != 1 {
			t.Errorf("%s ran %d times, want once", id, *n.(*int))
		}
	}
}

// TestStateShutdownKeepsUndelivered: a graceful shutdown that stops
// callbacks the trainer is not taking leaves them owed, and the next start
// delivers them, once.
func TestStateShutdownKeepsUndelivered(t *testing.T) {
	g := labelGrader()
	var runs sync.Map
	wf := heldOrMultiply(t, &runs)
	dir := t.TempDir()
	a := newHarness(t, harnessOpts{wf: wf, cfg: stateConfig(dir, g)})
	a.g2.SetDown(true)
	a.start(t, a.startReq(t, "late-1"))
	waitLogged(t, dir, `"id":"late-1","stage":"final"`)
	a.stop(t)
	a.g2.SetDown(false)

	b := newHarness(t, harnessOpts{share: a, wf: wf, cfg: stateConfig(dir, g)})
	comp, gcb := b.waitCompletion(t, "late-1"), b.waitGrader(t, "late-1")
	if comp.Status != "success" || gcb.Status != "success" {
		t.Errorf("completion %s, grader callback %s; want both success", comp.Raw, gcb.Raw)
	}
	waitQuiet(a.g2, []string{"late-1"})
	if c, gc := len(a.g2.Completions("late-1")), len(a.g2.GraderCallbacks("late-1")); c != 1 || gc != 1 {
		t.Errorf("%d completions and %d grader callbacks, want one each", c, gc)
	}
}

// TestStateCompaction: with a small compaction mark the log stays near
// what is live however many rollouts pass, and what it keeps still answers
// for every finished rollout after a restart.
func TestStateCompaction(t *testing.T) {
	var runs sync.Map
	wf := heldOrMultiply(t, &runs)
	dir := t.TempDir()
	const mark = 16 << 10
	reg := prometheus.NewRegistry()
	cfg := func(c *rollout.Config) {
		stateConfig(dir, nil)(c)
		c.StateCompactBytes = mark
	}
	a := newHarness(t, harnessOpts{wf: wf, cfg: func(c *rollout.Config) { cfg(c); c.Metrics = reg }})
	var ids []string
	var written int64
	for i := range 40 {
		id := fmt.Sprintf("c-%02d", i)
		ids = append(ids, id)
		a.start(t, a.startReq(t, id))
		a.waitCompletion(t, id)
		a.waitDone(t, id)
		if fi, err := os.Stat(filepath.Join(dir, stateFile)); err == nil {
			written = max(written, fi.Size())
		}
	}
	// Each rollout waited for its acceptance and its two stages' callbacks
	// to be on disk, and the gauge follows the log.
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var syncs uint64
	var size float64
	for _, f := range families {
		switch f.GetName() {
		case "osmo_state_log_sync_seconds":
			syncs = f.GetMetric()[0].GetHistogram().GetSampleCount()
		case "osmo_state_log_bytes":
			size = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if syncs < 3*40 || size <= 0 || size > 4*mark {
		t.Errorf("osmo_state_log_sync_seconds counted %d waits and osmo_state_log_bytes is %v; want at least 120 and a size under %d", syncs, size, 4*mark)
	}
	a.stop(t)
	fi, err := os.Stat(filepath.Join(dir, stateFile))
	if err != nil {
		t.Fatal(err)
	}
	// Each rollout writes about 2 KiB (its request, callbacks, marks);
	// 40 of them uncompacted would be past 60 KiB.
	if written > 4*mark || fi.Size() > 4*mark {
		t.Errorf("state log reached %d bytes and ended at %d with a %d-byte compaction mark", written, fi.Size(), mark)
	}
	b := newHarness(t, harnessOpts{share: a, wf: wf, cfg: cfg})
	for _, id := range ids {
		if st := b.status(t, id); st.GetStatus() != "success" {
			t.Errorf("status of %s after the restart = %v, want success", id, st)
		}
	}
}
