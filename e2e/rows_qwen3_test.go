//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/qwen3policy"
)

// apiRow is a training row as GET /v1/rollouts/{id}/rows answers it.
type apiRow struct {
	RolloutID string    `json:"rollout_id"`
	SampleID  string    `json:"sample_id"`
	Row       int       `json:"row"`
	TokenIDs  []int     `json:"token_ids"`
	LossMask  []int     `json:"loss_mask"`
	Logprobs  []float64 `json:"logprobs"`
	Reward    *float64  `json:"reward"`
	Merge     string    `json:"merge"`
	Calls     []int     `json:"calls"`
	Drift     []struct {
		Call     int    `json:"call"`
		Position int    `json:"position"`
		Class    string `json:"class"`
	} `json:"drift"`
	Problems []struct {
		Call   int    `json:"call"`
		Reason string `json:"reason"`
	} `json:"problems"`
}

// getRows answers GET /v1/rollouts/{id}/rows.
func getRows(t *testing.T, base, id, merge string) []apiRow {
	t.Helper()
	rows, _ := getRowsAndSamples(t, base, id, merge)
	return rows
}

// sampleRows is a sample's summary in GET /v1/rollouts/{id}/rows.
type sampleRows struct {
	SampleID string `json:"sample_id"`
	Rows     int    `json:"rows"`
	Problems []struct {
		Call   int    `json:"call"`
		Reason string `json:"reason"`
	} `json:"problems"`
}

// getRowsAndSamples answers GET /v1/rollouts/{id}/rows whole.
func getRowsAndSamples(t *testing.T, base, id, merge string) ([]apiRow, []sampleRows) {
	t.Helper()
	url := base + "/v1/rollouts/" + id + "/rows"
	if merge != "" {
		url += "?merge=" + merge
	}
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+serverKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, data)
	}
	var out struct {
		Rows    []apiRow     `json:"rows"`
		Samples []sampleRows `json:"samples"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		t.Fatalf("GET %s: %v in %s", url, err, data)
	}
	return out.Rows, out.Samples
}

// expectedRows merges what the policy saw and generated, call by call,
// exactly as a row is defined: a call joins the row while its prompt
// starts with the row so far; else a new row starts with it.
func expectedRows(calls []qwen3policy.Call) [][]int {
	var rows [][]int // per row, the tokens; masks and logprobs checked by position
	var row []int
	for _, c := range calls {
		if row != nil && len(c.PromptIDs) >= len(row) && slices.Equal(c.PromptIDs[:len(row)], row) {
			row = append(row, c.PromptIDs[len(row):]...)
		} else {
			if row != nil {
				rows = append(rows, row)
			}
			row = slices.Clone(c.PromptIDs)
		}
		row = append(row, c.CompletionIDs...)
	}
	if row != nil {
		rows = append(rows, row)
	}
	return rows
}

// TestRowsAgainstQwen3Policy drives `osmo serve` as a v0.3 controller does
// (TestEvalRowsOnTheQwen3Double does the same through osmo eval run),
// against a policy that renders Qwen3's chat template and tokenizes with
// its tokenizer, through the plain, reasoning, re-serialized tool-call and
// non-thinking scenarios, and checks every row against what the policy
// saw and generated: the tokens, the mask exactly on generated tokens,
// the logprobs there, the calls, and the drift named as the scenario
// produces it.
func TestRowsAgainstQwen3Policy(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end")
	}
	for _, tc := range []struct {
		scenario string
		// drift is the class of each break, one per rollout's break.
		drift []string
	}{
		{"plain", nil},
		{"reasoning", []string{"reasoning_dropped"}},
		{"reserialize", []string{"tool_call_reserialized"}},
		{"nothink", []string{"reasoning_dropped"}},
	} {
		t.Run(tc.scenario, func(t *testing.T) {
			policy := qwen3policy.Start(t, qwen3policy.Options{Scenario: tc.scenario})
			srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", "multiply", "--grader", "multiply",
				"--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
			base := addrs["http"]
			waitHTTP(t, srv, base+"/health")
			ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
				PolicyURL: policy.URL(), CallbackKey: "K-callbacks", CallbackTimeout: 60 * time.Second, Logger: quietLog(),
			})
			if err != nil {
				t.Fatal(err)
			}
			serveUntilEnd(t, ctl.Serve)

			for i, q := range [][2]int{{6, 7}, {12, 11}} {
				ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
				defer cancel()
				if err := policy.Reset(ctx); err != nil {
					t.Fatal(err)
				}
				id := fmt.Sprintf("rows-%s-%d", tc.scenario, i)
				label := fmt.Sprint(q[0] * q[1])
				res, err := ctl.Run(ctx, base, serverKey, controller.V03RunRequest{
					RolloutID: id,
					Messages:  []map[string]any{{"role": "user", "content": fmt.Sprintf("What is %d times %d?", q[0], q[1])}},
					Label:     &label,
				})
				if err != nil || res.Status != "success" || res.Sample == nil || res.Sample.Reward == nil {
					t.Fatalf("rollout %s: %+v %v\nserver output:\n%s", id, res, err, srv.Output())
				}
				calls, err := policy.Record(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if len(calls) < 2 {
					t.Fatalf("rollout %s: the policy saw %d calls, want a tool loop", id, len(calls))
				}
				want := expectedRows(calls)
				got := getRows(t, base, id, "")
				checkRows(t, id, calls, want, got, *res.Sample.Reward)

				var classes []string
				for _, r := range got {
					for _, d := range r.Drift {
						classes = append(classes, d.Class)
					}
				}
				if !slices.Equal(classes, tc.drift) {
					t.Errorf("rollout %s: drift %q, want %q", id, classes, tc.drift)
				}
				if tc.drift != nil {
					// Realign keeps one row, with the policy's own tokens.
					re := getRows(t, base, id, "realign")
					if len(re) != 1 || re[0].Merge != "realigned" || len(re[0].Calls) != len(calls) {
						t.Errorf("rollout %s: realign gave %d rows (%+v), want one realigned row of every call", id, len(re), re)
					}
				}
			}
		})
	}
}

// TestRowsWithAHostedPolicy: a policy that refuses the token parameters
// (a hosted API's 400) is asked again without them; the rollouts succeed
// and are graded, their samples have no rows and say why, and later calls
// do not ask it again.
func TestRowsWithAHostedPolicy(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end")
	}
	policy := qwen3policy.Start(t, qwen3policy.Options{Fault: "hosted"})
	srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", "multiply", "--grader", "multiply",
		"--api-key", serverKey, "-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
	base := addrs["http"]
	waitHTTP(t, srv, base+"/health")
	ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
		PolicyURL: policy.URL(), CallbackKey: "K-callbacks", CallbackTimeout: 60 * time.Second, Logger: quietLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		id := fmt.Sprintf("hosted-%d", i)
		label := "42"
		res, err := ctl.Run(ctx, base, serverKey, controller.V03RunRequest{
			RolloutID: id, Label: &label, Messages: []map[string]any{{"role": "user", "content": "What is 6 times 7?"}},
		})
		if err != nil || res.Status != "success" || res.Sample == nil || res.Sample.Reward == nil || *res.Sample.Reward != 1 {
			t.Fatalf("rollout %s: %+v %v\nserver output:\n%s", id, res, err, srv.Output())
		}
		rows, samples := getRowsAndSamples(t, base, id, "")
		if len(rows) != 0 || len(samples) != 1 || samples[0].Rows != 0 || len(samples[0].Problems) == 0 ||
			!strings.Contains(samples[0].Problems[0].Reason, "answered 400") {
			t.Errorf("rollout %s: rows %+v, samples %+v; want none, and the sample saying the policy refused", id, rows, samples)
		}
	}
	calls, err := policy.Record(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// One refused call, then every call plain: the refusal is remembered.
	refused := 0
	for _, c := range calls {
		if c.Status == http.StatusBadRequest {
			refused++
		}
	}
	if refused != 1 || len(calls) < 5 {
		t.Errorf("the policy saw %d calls, %d refused; want one refusal, then plain calls", len(calls), refused)
	}
}

// checkRows compares the rows the API answered with the rows the policy's
// record defines.
func checkRows(t *testing.T, id string, calls []qwen3policy.Call, want [][]int, got []apiRow, reward float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("rollout %s: %d rows, want %d", id, len(got), len(want))
	}
	next := 0 // the next call a row should cover
	for r, row := range got {
		if row.Row != r || row.RolloutID != id || row.Reward == nil || *row.Reward != reward {
			t.Errorf("rollout %s row %d: row %d of %s, reward %v, want reward %v", id, r, row.Row, row.RolloutID, row.Reward, reward)
		}
		if len(row.LossMask) != len(row.TokenIDs) || len(row.Logprobs) != len(row.TokenIDs) {
			t.Fatalf("rollout %s row %d: %d tokens, %d mask, %d logprobs", id, r, len(row.TokenIDs), len(row.LossMask), len(row.Logprobs))
		}
		if !slices.Equal(row.TokenIDs, want[r]) {
			t.Errorf("rollout %s row %d: tokens differ from the policy's record (%d against %d)", id, r, len(row.TokenIDs), len(want[r]))
			continue
		}
		wantMerge := "exact"
		if r > 0 {
			wantMerge = "forked"
		}
		if row.Merge != wantMerge {
			t.Errorf("rollout %s row %d: merge %q, want %q", id, r, row.Merge, wantMerge)
		}
		// Each call of the row: its prompt is the row up to its completion,
		// its completion masked 1 with the policy's logprobs.
		mask := make([]int, len(row.TokenIDs))
		lps := make([]float64, len(row.TokenIDs))
		for _, ci := range row.Calls {
			if ci != next {
				t.Fatalf("rollout %s row %d: covers call %d, want %d", id, r, ci, next)
			}
			next++
			c := calls[ci]
			end := len(c.PromptIDs) + len(c.CompletionIDs)
			if end > len(row.TokenIDs) || !slices.Equal(row.TokenIDs[:len(c.PromptIDs)], c.PromptIDs) {
				t.Fatalf("rollout %s row %d: call %d's prompt is not the row's prefix", id, r, ci)
			}
			for j := range c.CompletionIDs {
				mask[len(c.PromptIDs)+j] = 1
				lps[len(c.PromptIDs)+j] = c.Logprobs[j]
			}
		}
		if !slices.Equal(row.LossMask, mask) {
			t.Errorf("rollout %s row %d: loss mask is not 1 exactly on generated tokens", id, r)
		}
		if !slices.Equal(row.Logprobs, lps) {
			t.Errorf("rollout %s row %d: logprobs are not the policy's on generated tokens, 0 elsewhere", id, r)
		}
	}
	if next != len(calls) {
		t.Errorf("rollout %s: rows cover %d of %d calls", id, next, len(calls))
	}
}
