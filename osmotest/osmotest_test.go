package osmotest_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

func TestSourcesInRegistrationOrder(t *testing.T) {
	r := osmotest.NewRollout("r", nil)
	if got := osmotest.Sources(r); len(got) != 0 {
		t.Fatalf("Sources of a new rollout = %v, want none", got)
	}
	for _, id := range []string{"zeta", "alpha", "mid"} {
		if err := r.Register(id, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return nil, nil })); err != nil {
			t.Fatal(err)
		}
	}
	got := osmotest.Sources(r)
	if len(got) != 3 || got[0].ID != "zeta" || got[1].ID != "alpha" || got[2].ID != "mid" || got[0].Source == nil {
		t.Fatalf("Sources = %v, want zeta, alpha, mid with their sources", got)
	}
	got[0].ID = "changed"
	if again := osmotest.Sources(r); again[0].ID != "zeta" {
		t.Errorf("changing the returned slice changed the rollout: %v", again)
	}
}

func TestContextWithRollout(t *testing.T) {
	r := osmotest.NewRollout("r", nil)
	got, err := osmo.RolloutFromContext(osmotest.ContextWithRollout(context.Background(), r))
	if err != nil || got != r {
		t.Fatalf("RolloutFromContext = %p, %v; want %p", got, err, r)
	}
	if _, err := osmo.RolloutFromContext(osmotest.ContextWithRollout(context.Background(), nil)); !errors.Is(err, osmo.ErrNoRollout) {
		t.Errorf("a nil rollout installed: %v, want ErrNoRollout", err)
	}
}

// TestNewGraderContext: samples are keyed by id, and the context takes
// rewards and removals from concurrent graders.
func TestNewGraderContext(t *testing.T) {
	label := "42"
	gc := osmotest.NewGraderContext("r", []*osmo.Sample{{ID: "a"}, {ID: "b"}, {ID: "c"}}, &label, map[string]any{"k": "v"})
	if gc.RolloutID != "r" || len(gc.Samples) != 3 || gc.Samples["b"].ID != "b" || *gc.Label != "42" || gc.Metadata["k"] != "v" {
		t.Fatalf("context = %+v", gc)
	}
	var wg sync.WaitGroup
	for _, id := range []string{"a", "b"} {
		wg.Go(func() {
			if err := gc.SetSampleReward(id, 1); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Go(func() {
		if err := gc.RemoveSample("c"); err != nil {
			t.Error(err)
		}
	})
	wg.Wait()
	if r, ok := gc.Reward("a"); !ok || r != 1 {
		t.Errorf("Reward(a) = %v, %v", r, ok)
	}
	if !gc.Removed("c") || len(gc.Ungraded()) != 0 {
		t.Errorf("removed c: %v, ungraded %v", gc.Removed("c"), gc.Ungraded())
	}
}
