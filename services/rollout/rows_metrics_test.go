package rollout_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/services/rollout"
)

// rowCounts sums what the rows of a rollout say, as the metrics count them.
func rowCounts(t *testing.T, h *harness, id string) (merges map[string]float64, drift map[string]float64, points int) {
	t.Helper()
	merges, drift = map[string]float64{}, map[string]float64{}
	for _, row := range rowsOf(t, h.client, id) {
		merges[row.GetMerge()]++
		for _, d := range row.GetDrift() {
			drift[d.GetClass()]++
			points++
		}
	}
	return merges, drift, points
}

// TestRowsMetricsAndDriftEvents: with rows on, each finished rollout's
// rows are counted by merge and drift class once, its drift points are
// events of its span, and a sample without tokens is counted.
func TestRowsMetricsAndDriftEvents(t *testing.T) {
	reg := prometheus.NewRegistry()
	h, exp, _ := traced(t, harnessOpts{cfg: func(c *rollout.Config) { c.Metrics, c.Rows = reg, true }})
	h.runTokenRollout(t, "count-1", 6, 7)
	h.runTokenRollout(t, "count-2", 3, 4)
	// An agent that says no to token ids gets none: the proxy adds only
	// what the agent left unset.
	noTokens := h.initReq(t, "count-none", 1, 2, nil)
	noTokens.CompletionParams = mustStruct(t, map[string]any{"return_token_ids": false})
	if _, err := h.client.InitRollout(t.Context(), noTokens); err != nil {
		t.Fatal(err)
	}
	h.waitDone(t, "count-none")

	merges, drift, points := rowCounts(t, h, "count-1")
	m2, d2, p2 := rowCounts(t, h, "count-2")
	for k, v := range m2 {
		merges[k] += v
	}
	for k, v := range d2 {
		drift[k] += v
	}
	if merges["exact"] != 2 {
		t.Fatalf("rows by merge = %v, want one exact row per rollout", merges)
	}
	// The mock policy's prompts re-render the earlier turns: each fork is
	// a drift point, and so an event.
	if merges["forked"] == 0 || float64(points+p2) < merges["forked"] {
		t.Fatalf("rows by merge %v with %d drift points: want forks, each at a drift point", merges, points+p2)
	}
	for _, merge := range []string{"exact", "forked"} {
		if got, err := gatherValue(reg, "osmo_rows_total", merge); err != nil || got != merges[merge] {
			t.Errorf("osmo_rows_total{merge=%q} = %v (%v), want %v", merge, got, err, merges[merge])
		}
	}
	for _, class := range []string{"reasoning_dropped", "tool_call_reserialized", "whitespace", "other"} {
		if got, err := gatherValue(reg, "osmo_row_drift_total", class); err != nil || got != drift[class] {
			t.Errorf("osmo_row_drift_total{class=%q} = %v (%v), want %v", class, got, err, drift[class])
		}
	}
	if got, err := gatherValue(reg, "osmo_samples_without_tokens_total"); err != nil || got != 1 {
		t.Errorf("osmo_samples_without_tokens_total = %v (%v), want 1", got, err)
	}

	// Every drift point is an event of its rollout's span, named by class.
	events := 0
	for _, s := range waitSpan(t, exp, "rollout").named("rollout") {
		for _, e := range s.Events {
			if e.Name != "row_drift" {
				continue
			}
			events++
			attrs := attribute.NewSet(e.Attributes...)
			if v, ok := attrs.Value(osmoattr.DriftClass); !ok || v.AsString() == "" {
				t.Errorf("row_drift event without a class: %v", e.Attributes)
			}
			if _, ok := attrs.Value(osmoattr.SampleID); !ok {
				t.Errorf("row_drift event without the sample id: %v", e.Attributes)
			}
		}
	}
	if events != points+p2 {
		t.Errorf("%d row_drift events, want %d", events, points+p2)
	}
}

// TestRowsMetricsOff: with rows off nothing is built or counted, and the
// API still derives the rows of what was recorded.
func TestRowsMetricsOff(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Metrics, c.Rows = reg, false }})
	h.runTokenRollout(t, "off-1", 6, 7)
	for _, merge := range []string{"exact", "forked"} {
		if got, _ := gatherValue(reg, "osmo_rows_total", merge); got != 0 {
			t.Errorf("osmo_rows_total{merge=%q} = %v with rows off", merge, got)
		}
	}
	got, err := h.client.GetRolloutRows(t.Context(), &rolloutv1.GetRolloutRowsRequest{RolloutId: "off-1"})
	if err != nil || len(got.GetRows()) == 0 {
		t.Errorf("GetRolloutRows with rows off: %v, %v", got, err)
	}
}
