package eval_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/parquet-go/parquet-go"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/eval"
	"github.com/osmo-rl/osmo/internal/rows"
)

// Qwen3's end of turn, the stop token the engine returns.
const imEnd = 151645

// sampleCalls are the llm_calls the fake server's sample carries: "pass"
// (and "odd" run 1, a removed sample) two calls whose second prompt starts
// with the first prompt and completion, one row; "mixed" a second prompt
// that parts from the first completion, two rows, but run 3 sends calls
// that do not decode, no row; "odd" run 2 one call without token ids, no
// row. Other attempts send no sample.
func sampleCalls(label string, run int) any {
	if label == "mixed" && run == 3 {
		return map[string]any{"prompt_token_ids": "not a list of calls"}
	}
	return goodCalls(label, run)
}

func goodCalls(label string, run int) []map[string]any {
	first := map[string]any{"prompt_token_ids": []int{1, 2, 3}, "completion_token_ids": []int{10, 11, imEnd},
		"logprobs": []float64{-0.1, -0.2, -0.3}, "completion_token_strings": []string{"a", "b", "<|im_end|>"},
		"request_messages": []map[string]any{{"role": "user", "content": "the key is s3cret"}}, "response_message": map[string]any{"role": "assistant", "content": "s3cret: 42"}}
	switch {
	case label == "pass" || (label == "odd" && run == 1):
		return []map[string]any{first, {"prompt_token_ids": []int{1, 2, 3, 10, 11, imEnd, 4, 5}, "completion_token_ids": []int{12, imEnd},
			"logprobs": []float64{-0.4, -0.5}, "completion_token_strings": []string{"c", "<|im_end|>"}}}
	case label == "mixed":
		return []map[string]any{first, {"prompt_token_ids": []int{1, 2, 3, 10, 99, imEnd, 4}, "completion_token_ids": []int{13, imEnd},
			"logprobs": []float64{-0.6, -0.7}, "completion_token_strings": []string{"d", "<|im_end|>"}}}
	case label == "odd" && run == 2:
		return []map[string]any{{"no_tokens_reason": "the policy refused the token parameters"}}
	}
	return nil
}

var rowOfID = regexp.MustCompile(`-r(\d+)-n(\d+)$`)

// recordOf is the record osmo's rollout server holds for id: its sample's
// calls as the callback sends them, with the token strings the callback
// leaves out (here marked "rec:").
func recordOf(id string) map[string]any {
	m := rowOfID.FindStringSubmatch(id)
	if m == nil {
		return nil
	}
	row, _ := strconv.Atoi(m[1])
	run, _ := strconv.Atoi(m[2])
	calls := goodCalls(*testRows()[row].Label, run)
	for _, c := range calls {
		var strs []string
		for _, s := range c["completion_token_strings"].([]string) {
			strs = append(strs, "rec:"+s)
		}
		c["completion_token_strings"] = strs
	}
	return map[string]any{"rollout_id": id, "state": "STATE_SUCCEEDED", "samples": []map[string]any{{"id": "s-" + id, "llm_calls": calls}}}
}

// TestRowsCallsFromTheRecord: with an osmo rollout server, a sample's
// calls are read whole from the rollout's record, token strings included;
// a server without records (an SDK's, answering 404) is asked once, and
// the callback's calls stand.
func TestRowsCallsFromTheRecord(t *testing.T) {
	for _, records := range []bool{true, false} {
		out := filepath.Join(t.TempDir(), "run")
		p := testPlan(t, out, 2)
		srv := newFakeServer(t)
		srv.records = records
		// One at a time: a server without records is asked once (several
		// grader callbacks at once may each ask before the first answer).
		p.ServerURL, p.TrainingRows, p.BatchSize = srv.srv.URL, true, 1
		rep, err := eval.Run(context.Background(), p)
		if err != nil {
			t.Fatal(err)
		}
		withCalls := 0
		for _, r := range rep.Results {
			if len(r.LLMCalls) == 0 || len(r.LLMCalls[0].CompletionTokenStrings) == 0 {
				continue
			}
			withCalls++
			if got := strings.HasPrefix(r.LLMCalls[0].CompletionTokenStrings[0], "rec:"); got != records {
				t.Errorf("records %v, row %d run %d: token strings %q", records, r.RowIndex, r.RunIndex, r.LLMCalls[0].CompletionTokenStrings)
			}
		}
		// pass 2, mixed 2, odd run 1.
		if withCalls != 5 {
			t.Errorf("records %v: %d results with calls, want 5", records, withCalls)
		}
		if n := srv.recordGets.Load(); !records && n != 1 {
			t.Errorf("a server without records was asked %d times, want once", n)
		}
		// pass 2 × 1, mixed 2 × 2, odd run 1's 1.
		if got := readRowsFiles(t, out); len(got) != 7 {
			t.Errorf("records %v: %d rows, want 7", records, len(got))
		}
	}
}

// fileRow is a row of rows.jsonl and of rows.parquet, as a trainer reads
// either: the columns by name.
type fileRow struct {
	RowIndex  int64     `json:"row_index" parquet:"row_index"`
	RunIndex  int64     `json:"run_index" parquet:"run_index"`
	RolloutID string    `json:"rollout_id" parquet:"rollout_id"`
	SampleID  string    `json:"sample_id" parquet:"sample_id"`
	Row       int32     `json:"row" parquet:"row"`
	TokenIDs  []int32   `json:"token_ids" parquet:"token_ids,list"`
	LossMask  []int32   `json:"loss_mask" parquet:"loss_mask,list"`
	Logprobs  []float64 `json:"logprobs" parquet:"logprobs,list"`
	Reward    *float64  `json:"reward" parquet:"reward,optional"`
	Merge     string    `json:"merge" parquet:"merge"`
	Calls     []int32   `json:"calls" parquet:"calls,list"`
	Drift     []struct {
		Call                int32  `json:"call" parquet:"call"`
		Position            int32  `json:"position" parquet:"position"`
		Class               string `json:"class" parquet:"class"`
		ContextTokensDiffer int32  `json:"context_tokens_differ" parquet:"context_tokens_differ"`
	} `json:"drift" parquet:"drift,list"`
	Problems []struct {
		Call   int32  `json:"call" parquet:"call"`
		Reason string `json:"reason" parquet:"reason"`
	} `json:"problems" parquet:"problems,list"`
}

// readRowsFiles reads rows.jsonl and rows.parquet and fails unless they
// hold the same rows.
func readRowsFiles(t *testing.T, dir string) []fileRow {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, eval.RowsFile))
	if err != nil {
		t.Fatal(err)
	}
	var fromJSON []fileRow
	for line := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
		if line == "" {
			continue
		}
		var r fileRow
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("rows.jsonl: %q: %v", line, err)
		}
		fromJSON = append(fromJSON, r)
	}
	fromParquet, err := parquet.ReadFile[fileRow](filepath.Join(dir, eval.RowsParquetFile))
	if err != nil {
		t.Fatalf("rows.parquet: %v", err)
	}
	// Empty lists read back as nil from one and [] from the other.
	for _, rs := range [][]fileRow{fromJSON, fromParquet} {
		for i := range rs {
			if len(rs[i].Drift) == 0 {
				rs[i].Drift = nil
			}
			if len(rs[i].Problems) == 0 {
				rs[i].Problems = nil
			}
		}
	}
	if len(fromJSON) != len(fromParquet) {
		t.Fatalf("rows.jsonl has %d rows, rows.parquet %d", len(fromJSON), len(fromParquet))
	}
	for i := range fromJSON {
		if !reflect.DeepEqual(fromJSON[i], fromParquet[i]) {
			t.Errorf("row %d:\njsonl   %+v\nparquet %+v", i, fromJSON[i], fromParquet[i])
		}
	}
	return fromJSON
}

// expectedRows builds each attempt's rows from the calls the fake server
// sent, as the API builds them, to check the files and the summary's
// counts against.
func expectedRows(t *testing.T, res []eval.Result, merge string) (byAttempt map[[2]int][]rows.Row, drift map[string]int) {
	t.Helper()
	byAttempt, drift = map[[2]int][]rows.Row{}, map[string]int{}
	for _, r := range res {
		label := *testRows()[r.RowIndex].Label
		b, _ := json.Marshal(goodCalls(label, r.RunIndex))
		var calls []*osmo.LLMCall
		if err := json.Unmarshal(b, &calls); err != nil {
			t.Fatal(err)
		}
		if label == "mixed" && r.RunIndex == 3 {
			calls = nil // sent as something else than calls
		}
		if r.Status == eval.StatusFailed && r.ErrCategory != "workflow_failed" {
			continue // no sample was sent
		}
		built := rows.Build(rows.Sample{RolloutID: r.RolloutID, SampleID: "s-" + r.RolloutID, Reward: r.Reward, Calls: calls}, rows.Options{Merge: merge})
		byAttempt[[2]int{r.RowIndex, r.RunIndex}] = built.Rows
		for _, row := range built.Rows {
			for _, d := range row.Drift {
				drift[d.Class]++
			}
		}
	}
	return byAttempt, drift
}

// TestRunWritesRows: rows on, a run writes rows.jsonl and rows.parquet
// holding the same rows, each attempt's rows as the builder makes them
// from the sample's calls, with the dataset row and run; the summary (and
// its table, and the report) count them right.
func TestRunWritesRows(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	p := testPlan(t, out, 4)
	p.TrainingRows = true
	rep, err := eval.Run(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	got := readRowsFiles(t, out)
	want, drift := expectedRows(t, rep.Results, rows.MergeExact)
	var n int
	for _, rs := range want {
		n += len(rs)
	}
	// pass: 4 × 1 row; mixed: 3 × 2 (exact, forked); odd: run 1's row.
	if len(got) != 11 || n != 11 {
		t.Fatalf("%d rows in the files, %d built, want 11", len(got), n)
	}
	seen := map[[2]int]int{}
	for _, g := range got {
		k := [2]int{int(g.RowIndex), int(g.RunIndex)}
		ws := want[k]
		i := seen[k]
		seen[k]++
		if i >= len(ws) {
			t.Fatalf("attempt %v: more rows in the file than built", k)
		}
		w := ws[i]
		if g.RolloutID != w.RolloutID || g.SampleID != "s-"+w.RolloutID || int(g.Row) != w.Row || g.Merge != w.Merge ||
			!reflect.DeepEqual(g.TokenIDs, w.TokenIDs) || !reflect.DeepEqual(g.LossMask, w.LossMask) || !reflect.DeepEqual(g.Logprobs, w.Logprobs) ||
			!reflect.DeepEqual(g.Reward, w.Reward) || len(g.Calls) != len(w.Calls) || len(g.Drift) != len(w.Drift) {
			t.Errorf("attempt %v row %d:\nfile  %+v\nbuilt %+v", k, i, g, w)
		}
	}
	// The plain two-call sample, spelled out.
	first := got[0]
	if first.RowIndex != 0 || first.RunIndex != 0 || first.Merge != rows.MergeExact ||
		!reflect.DeepEqual(first.TokenIDs, []int32{1, 2, 3, 10, 11, imEnd, 4, 5, 12, imEnd}) ||
		!reflect.DeepEqual(first.LossMask, []int32{0, 0, 0, 1, 1, 1, 0, 0, 1, 1}) ||
		!reflect.DeepEqual(first.Logprobs, []float64{0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5}) ||
		!reflect.DeepEqual(first.Calls, []int32{0, 1}) || first.Reward == nil || *first.Reward != 1 {
		t.Errorf("first row %+v", first)
	}
	for _, g := range got {
		if g.RowIndex == 1 && g.Row == 1 && g.Merge != rows.MergeForked {
			t.Errorf("mixed's second row: merge %q, want forked", g.Merge)
		}
		if g.RowIndex == 2 && (g.RunIndex != 1 || g.Reward != nil) {
			t.Errorf("odd: a row of run %d (reward %v); only run 1, removed and without a reward, has calls", g.RunIndex, g.Reward)
		}
	}

	rs := rep.Summary.Rows
	if rs == nil {
		t.Fatal("the summary has no rows")
	}
	noTokens := rows.Build(rows.Sample{Calls: []*osmo.LLMCall{{NoTokensReason: "the policy refused the token parameters"}}}, rows.Options{}).Problems[0].Reason
	wantSummary := eval.RowsSummary{
		Merge: rows.MergeExact, Samples: 12, SamplesWithRows: 8, SamplesWithoutTokens: 4,
		WithoutTokens: map[string]int{"the attempt failed before its sample was sent": 2, noTokens: 1, "the rollout server recorded no llm_calls": 1},
		Rows:          11, RowsPerSample: 11.0 / 8, ByMerge: map[string]int{rows.MergeExact: 8, rows.MergeForked: 3},
		Drift: drift, ProblemCalls: 1,
	}
	if !reflect.DeepEqual(*rs, wantSummary) {
		t.Errorf("rows summary\n%+v\nwant\n%+v", *rs, wantSummary)
	}
	var file struct {
		Rows eval.RowsSummary `json:"rows"`
	}
	readJSON(t, filepath.Join(out, eval.SummaryFile), &file)
	if !reflect.DeepEqual(file.Rows, wantSummary) {
		t.Errorf("summary.json rows %+v", file.Rows)
	}
	var table bytes.Buffer
	if err := rep.Summary.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	// Columns aligned by width: compared with single spaces.
	flat := strings.Join(strings.Fields(table.String()), " ")
	for _, line := range []string{
		"training rows 11 (exact) from 8 of 12 samples, 1.38 per sample; exact 8 · forked 3 ",
		"samples without tokens 4: " + noTokens + " 1 · the attempt failed before its sample was sent 2 · the rollout server recorded no llm_calls 1 ",
		"calls left out 1 ",
	} {
		if !strings.Contains(flat, line) {
			t.Errorf("the summary table lacks %q:\n%s", line, table.String())
		}
	}
	page, err := os.ReadFile(filepath.Join(out, eval.ReportFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{`id="training-rows"`, "<td>rows forked</td><td class=\"num\">3</td>",
		"training rows: 1 (exact)", "training rows: 2 (exact, forked)", "training rows: none: the attempt failed before its sample was sent"} {
		if !bytes.Contains(page, []byte(s)) {
			t.Errorf("report.html lacks %q", s)
		}
	}
	// The calls are journaled with the result: a resume derives from them.
	// Calls that do not decode cost the sample its rows, not its result.
	for _, l := range jsonLinesOf(t, filepath.Join(out, eval.ResultsFile)) {
		bad := l["row_index"] == 1.0 && l["run_index"] == 3.0
		if l["status"] == eval.StatusSuccess && (l["llm_calls"] == nil) != bad {
			t.Errorf("results.jsonl line: llm_calls %v", l)
		}
		if bad && (l["status"] != eval.StatusSuccess || l["reward"] != 0.0) {
			t.Errorf("the sample whose calls do not decode: %v", l)
		}
	}
}

// TestRowsRerunAndResume: a rerun that runs nothing writes the same rows;
// a resume that runs more attempts writes every attempt's rows, the
// earlier ones derived again from the journal, unchanged; the merge mode
// of the invocation is the rows'; rows off writes none, and keeps what an
// earlier invocation wrote current rather than behind the results.
func TestRowsRerunAndResume(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	p := testPlan(t, out, 2)
	p.TrainingRows = true
	if _, err := eval.Run(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(filepath.Join(out, eval.RowsFile))
	if err != nil {
		t.Fatal(err)
	}
	beforeRows := readRowsFiles(t, out)

	rep, err := eval.Run(context.Background(), p)
	if err != nil || rep.Ran != 0 {
		t.Fatalf("rerun: ran %d, %v", rep.Ran, err)
	}
	if again, _ := os.ReadFile(filepath.Join(out, eval.RowsFile)); !bytes.Equal(again, before) {
		t.Errorf("a rerun that ran nothing rewrote rows.jsonl differently:\n%s\nwas\n%s", again, before)
	}

	// More runs of each row: runs 0 and 1 are carried, 2 and 3 run.
	p.N = 4
	rep, err = eval.Run(context.Background(), p)
	if err != nil || rep.Ran != 6 || rep.Resumed != 6 {
		t.Fatalf("resume: ran %d resumed %d, %v", rep.Ran, rep.Resumed, err)
	}
	after := readRowsFiles(t, out)
	var carried []fileRow
	for _, r := range after {
		if r.RunIndex < 2 {
			carried = append(carried, r)
		}
	}
	if !reflect.DeepEqual(carried, beforeRows) {
		t.Errorf("the carried attempts' rows changed:\n%+v\nwas\n%+v", carried, beforeRows)
	}
	if len(after) != 11 || rep.Summary.Rows.Samples != 12 {
		t.Errorf("after the resume: %d rows of %d samples, want 11 of 12", len(after), rep.Summary.Rows.Samples)
	}

	// Another merge mode: the same calls, the rows in that mode.
	p.RowsMerge = rows.ModeRealign
	rep, err = eval.Run(context.Background(), p)
	if err != nil || rep.Summary.Rows.Merge != rows.ModeRealign {
		t.Fatalf("realign rerun: %v, rows %+v", err, rep.Summary.Rows)
	}
	want, _ := expectedRows(t, rep.Results, rows.ModeRealign)
	var n int
	for _, rs := range want {
		n += len(rs)
	}
	if got := readRowsFiles(t, out); len(got) != n {
		t.Errorf("realign: %d rows in the files, %d built", len(got), n)
	}

	// Rows off: the files stay, kept current.
	p.TrainingRows, p.RowsMerge = false, ""
	p.N = 5
	rep, err = eval.Run(context.Background(), p)
	if err != nil || rep.Ran != 3 {
		t.Fatalf("rows off: ran %d, %v", rep.Ran, err)
	}
	if rep.Summary.Rows == nil || rep.Summary.Rows.Samples != 15 || rep.Summary.Rows.SamplesWithoutTokens != 4+3 {
		t.Errorf("rows off over a run with rows: %+v; want the 3 new attempts counted without tokens", rep.Summary.Rows)
	}
	if got := readRowsFiles(t, out); len(got) != 11 {
		t.Errorf("rows off: %d rows, want the 11 of the attempts with calls", len(got))
	}
}

// TestRowsCallsRedacted: a secret in a call's messages is redacted in the
// journal like the result's own messages.
func TestRowsCallsRedacted(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	p := testPlan(t, out, 1)
	p.TrainingRows, p.Redact = true, eval.NewRedactor("s3cret")
	if _, err := eval.Run(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(out, eval.ResultsFile))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("s3cret")) || !bytes.Contains(b, []byte(`"content":"`+eval.Redacted+`: 42"`)) {
		t.Errorf("results.jsonl:\n%s", b)
	}
	if got := readRowsFiles(t, out); len(got) != 3 {
		t.Errorf("%d rows, want 3", len(got))
	}
}

// TestRowsOff: a run with rows off keeps no calls and writes no rows file.
func TestRowsOff(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	rep, err := eval.Run(context.Background(), testPlan(t, out, 1))
	if err != nil {
		t.Fatal(err)
	}
	if rep.Summary.Rows != nil || rep.TrainingRows != nil {
		t.Errorf("rows off: summary rows %+v, %d rows", rep.Summary.Rows, len(rep.TrainingRows))
	}
	for _, f := range []string{eval.RowsFile, eval.RowsParquetFile} {
		if _, err := os.Stat(filepath.Join(out, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: %v, want no file", f, err)
		}
	}
	for _, l := range jsonLinesOf(t, filepath.Join(out, eval.ResultsFile)) {
		if _, ok := l["llm_calls"]; ok {
			t.Errorf("rows off, results.jsonl keeps llm_calls: %v", l)
		}
	}
	var table bytes.Buffer
	_ = rep.Summary.WriteTable(&table)
	if strings.Contains(table.String(), "training rows") {
		t.Errorf("rows off, the table shows rows:\n%s", table.String())
	}
}
