package eval

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/parquet-go/parquet-go"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/rows"
	"github.com/osmo-rl/osmo/internal/sample"
)

// The run's training rows, beside results.jsonl.
const (
	RowsFile        = "rows.jsonl"
	RowsParquetFile = "rows.parquet"
)

// TrainingRow is a line of rows.jsonl: a training row as the API's Row
// has it, with the dataset row (row_index, as in results.jsonl) and the
// run of it that produced it.
type TrainingRow struct {
	RowIndex int `json:"row_index"`
	RunIndex int `json:"run_index"`
	rows.Row
}

// RowsSummary is the merge quality of a run's training rows: how many rows
// each sample gave, where the conversations drifted from a plain prefix,
// and which samples gave none.
type RowsSummary struct {
	// Merge is the mode the rows were built in: exact or realign.
	Merge string `json:"merge"`
	// Samples counts the attempts with a result; SamplesWithRows those
	// that gave at least one row; SamplesWithoutTokens the others, by
	// reason in WithoutTokens.
	Samples              int            `json:"samples"`
	SamplesWithRows      int            `json:"samples_with_rows"`
	SamplesWithoutTokens int            `json:"samples_without_tokens"`
	WithoutTokens        map[string]int `json:"without_tokens"`
	// Rows is how many rows there are, RowsPerSample their mean over the
	// samples with rows, ByMerge their count by merge (exact, forked,
	// realigned).
	Rows          int            `json:"rows"`
	RowsPerSample float64        `json:"rows_per_sample"`
	ByMerge       map[string]int `json:"by_merge"`
	// Drift counts the points where a call's prompt parted from the row
	// before it, by class.
	Drift map[string]int `json:"drift"`
	// ProblemCalls counts the calls whose tokens could not go into a row
	// (missing or inconsistent), in samples with rows or without.
	ProblemCalls int `json:"problem_calls"`
}

// Why a sample has no rows when none of its calls says.
const (
	noRowsFailed  = "the attempt failed before its sample was sent"
	noRowsNoCalls = "the rollout server recorded no llm_calls"
)

// buildRows derives the training rows of results (in their order) with
// o's merge mode ("" or exact, or realign) and vocabulary size, summarizes
// their quality, and says per attempt (by rollout id) what its rows are,
// for the report.
func buildRows(results []Result, o rows.Options) ([]TrainingRow, RowsSummary, map[string]string) {
	notes := map[string]string{}
	merge := cmp.Or(o.Merge, rows.MergeExact)
	o.Merge = merge
	s := RowsSummary{Merge: merge, Samples: len(results), WithoutTokens: map[string]int{},
		ByMerge: map[string]int{}, Drift: map[string]int{}}
	var out []TrainingRow
	for _, r := range results {
		built := rows.Build(rows.Sample{RolloutID: r.RolloutID, SampleID: r.SampleID, Reward: r.Reward, Calls: r.LLMCalls}, o)
		s.ProblemCalls += len(built.Problems)
		if len(built.Rows) == 0 {
			s.SamplesWithoutTokens++
			reason := noRowsNoCalls
			switch {
			case len(built.Problems) > 0:
				reason = built.Problems[0].Reason
			case r.Status == StatusFailed && r.SampleID == "" && len(r.LLMCalls) == 0:
				reason = noRowsFailed
			}
			s.WithoutTokens[reason]++
			notes[r.RolloutID] = "none: " + reason
			continue
		}
		s.SamplesWithRows++
		var merges []string
		drift := map[string]int{}
		for _, row := range built.Rows {
			s.Rows++
			s.ByMerge[row.Merge]++
			merges = append(merges, row.Merge)
			for _, d := range row.Drift {
				s.Drift[d.Class]++
				drift[d.Class]++
			}
			out = append(out, TrainingRow{RowIndex: r.RowIndex, RunIndex: r.RunIndex, Row: row})
		}
		note := fmt.Sprintf("%d (%s)", len(built.Rows), strings.Join(merges, ", "))
		if len(drift) > 0 {
			note += " · drift " + countsLine(drift)
		}
		if len(built.Problems) > 0 {
			note += fmt.Sprintf(" · %d calls left out", len(built.Problems))
		}
		notes[r.RolloutID] = note
	}
	if s.SamplesWithRows > 0 {
		s.RowsPerSample = float64(s.Rows) / float64(s.SamplesWithRows)
	}
	return out, s, notes
}

// recordTimeout bounds reading a rollout's record while its grader
// callback waits for the answer.
const recordTimeout = 5 * time.Second

// recordCalls reads sampleID's LLM calls from the rollout's record on an
// osmo rollout server (GET /v1/rollouts/{id}): whole, with the
// completion's token strings and the reason a call has no tokens, which
// the grader callback's llm_calls leave out (the wires carry only the
// fields they always have). ok is false when the server is no osmo or its
// record lacks the sample: the callback's calls then stand. A server that
// has no such route (404, 405, 501) is not asked again: noRecords is set.
func recordCalls(ctx context.Context, serverURL, key, rolloutID, sampleID string, noRecords *atomic.Bool) (calls []*osmo.LLMCall, ok bool) {
	if serverURL == "" || sampleID == "" || noRecords.Load() {
		return nil, false
	}
	ctx, cancel := context.WithTimeout(ctx, recordTimeout)
	defer cancel()
	status, body, err := send(ctx, http.MethodGet, strings.TrimRight(serverURL, "/")+"/v1/rollouts/"+url.PathEscape(rolloutID), key, nil, maxRecordBytes)
	switch {
	case err != nil:
		return nil, false
	case status == http.StatusNotFound || status == http.StatusMethodNotAllowed || status == http.StatusNotImplemented:
		noRecords.Store(true)
		return nil, false
	case status != http.StatusOK:
		return nil, false
	}
	var rec rolloutv1.Rollout
	if sample.FromJSON(body, &rec) != nil || rec.GetRolloutId() != rolloutID {
		return nil, false
	}
	for _, sm := range rec.GetSamples() {
		if sm.GetId() != sampleID {
			continue
		}
		calls = make([]*osmo.LLMCall, len(sm.GetLlmCalls()))
		for i, pc := range sm.GetLlmCalls() {
			calls[i] = &osmo.LLMCall{}
			if sample.FromProto(pc, calls[i]) != nil {
				return nil, false
			}
		}
		return calls, len(calls) > 0
	}
	return nil, false
}

// maxRecordBytes bounds a rollout record read for its calls: the server's
// own bound on a message (64 MiB).
const maxRecordBytes = 64 << 20

// parquetRow is a row of rows.parquet: rows.jsonl's fields under the same
// names, the arrays as Parquet lists.
type parquetRow struct {
	RowIndex  int64            `parquet:"row_index"`
	RunIndex  int64            `parquet:"run_index"`
	RolloutID string           `parquet:"rollout_id"`
	SampleID  string           `parquet:"sample_id"`
	Row       int32            `parquet:"row"`
	TokenIDs  []int32          `parquet:"token_ids,list"`
	LossMask  []int32          `parquet:"loss_mask,list"`
	Logprobs  []float64        `parquet:"logprobs,list"`
	Reward    *float64         `parquet:"reward,optional"`
	Merge     string           `parquet:"merge"`
	Calls     []int32          `parquet:"calls,list"`
	Drift     []parquetDrift   `parquet:"drift,list"`
	Problems  []parquetProblem `parquet:"problems,list"`
}

type parquetDrift struct {
	Call                int32  `parquet:"call"`
	Position            int32  `parquet:"position"`
	Class               string `parquet:"class"`
	ContextTokensDiffer int32  `parquet:"context_tokens_differ"`
}

type parquetProblem struct {
	Call   int32  `parquet:"call"`
	Reason string `parquet:"reason"`
}

func toParquet(t TrainingRow) parquetRow {
	p := parquetRow{
		RowIndex: int64(t.RowIndex), RunIndex: int64(t.RunIndex), RolloutID: t.RolloutID, SampleID: t.SampleID,
		Row: int32(t.Row.Row), TokenIDs: t.TokenIDs, LossMask: t.LossMask, Logprobs: t.Logprobs, Reward: t.Reward,
		Merge: t.Merge, Calls: make([]int32, len(t.Calls)),
	}
	for i, c := range t.Calls {
		p.Calls[i] = int32(c)
	}
	for _, d := range t.Drift {
		p.Drift = append(p.Drift, parquetDrift{Call: int32(d.Call), Position: int32(d.Position), Class: d.Class, ContextTokensDiffer: int32(d.ContextTokensDiffer)})
	}
	for _, pr := range t.Problems {
		p.Problems = append(p.Problems, parquetProblem{Call: int32(pr.Call), Reason: pr.Reason})
	}
	return p
}

// writeRows writes rows.jsonl and rows.parquet in dir, each whole (a
// temporary file, synced, then renamed): both are derived from the
// journal's results, so an invocation that resumes or reruns a run writes
// every attempt's rows again rather than appending to them.
func writeRows(dir string, trs []TrainingRow) error {
	var jsonl bytes.Buffer
	for _, t := range trs {
		line, err := marshalLine(t)
		if err != nil {
			return fmt.Errorf("eval: rows: %w", err)
		}
		jsonl.Write(line)
	}
	prows := make([]parquetRow, len(trs))
	for i, t := range trs {
		prows[i] = toParquet(t)
	}
	var pq bytes.Buffer
	if err := parquet.Write(&pq, prows); err != nil {
		return fmt.Errorf("eval: rows.parquet: %w", err)
	}
	return errors.Join(
		WriteFileAtomic(filepath.Join(dir, RowsFile), jsonl.Bytes()),
		WriteFileAtomic(filepath.Join(dir, RowsParquetFile), pq.Bytes()))
}

// hasRowsFiles reports whether dir holds rows files an earlier invocation
// wrote: they are kept current even when this one has rows off.
func hasRowsFiles(dir string) bool {
	for _, f := range []string{RowsFile, RowsParquetFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return true
		}
	}
	return false
}
