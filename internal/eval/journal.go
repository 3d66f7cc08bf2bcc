package eval

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/osmo-rl/osmo"
)

// Result is one sample attempt's terminal result: a line of results.jsonl.
type Result struct {
	// RowIndex is the row's position within the selected rows,
	// SourceRowIndex its position in the dataset file.
	RowIndex       int    `json:"row_index"`
	RunIndex       int    `json:"run_index"`
	SourceRowIndex int    `json:"source_row_index"`
	RolloutID      string `json:"rollout_id"`
	// Status is success, failed or skipped (the grader removed the
	// sample: it is left out of the pass rate).
	Status string `json:"status"`
	// ErrCategory is a failed attempt's error_type, in the SDK's words.
	ErrCategory string   `json:"err_category,omitempty"`
	ErrMessage  string   `json:"err_message,omitempty"`
	Reward      *float64 `json:"reward"`
	LatencyMS   float64  `json:"latency_ms"`
	Tokens      int      `json:"tokens"`
	// Messages is the sample's conversation or, when the rollout sent
	// none, the one its last LLM call carried.
	Messages []map[string]any `json:"messages"`
	TraceID  string           `json:"trace_id,omitempty"`
	// SampleID and LLMCalls are the sample's id and its LLM calls as the
	// rollout server recorded them (osmo's does; the SDK's sends none),
	// kept while rows are on: the run's training rows are derived from
	// them, so a resume or a rerun derives the same rows again.
	SampleID string          `json:"sample_id,omitempty"`
	LLMCalls []*osmo.LLMCall `json:"llm_calls,omitempty"`
}

// Result statuses, as the Osmosis SDK and platform write them.
const (
	StatusSuccess = "success"
	StatusFailed  = "failed"
	StatusSkipped = "skipped"
	// statusFailureOld is what osmo wrote for StatusFailed before it used
	// the SDK's word; a results.jsonl of an older run still reads.
	statusFailureOld = "failure"
)

// Key is a sample attempt: a row and a run of it.
type Key struct{ Row, Run int }

// Key is the result's attempt.
func (r Result) Key() Key { return Key{r.RowIndex, r.RunIndex} }

// Journal is the run's durable record of terminal results: results.jsonl
// (osmo's, with the conversation) and events.jsonl (the SDK's). Append
// fsyncs both lines before the rollout is acknowledged, so a run killed at
// any point leaves every acknowledged result on disk.
//
// events.jsonl is what a resume trusts: the last event of an attempt wins,
// and results.jsonl supplies its detail. A result line without its event
// (a kill between the two writes) was never acknowledged and is dropped; so
// is a torn last line. An older osmo's run has results.jsonl only, and its
// events.jsonl is written from it; the SDK's has events.jsonl only, and its
// results are read from the events.
type Journal struct {
	mu              sync.Mutex
	results, events *os.File
	// loaded are the rollout ids carried from an earlier invocation.
	loaded map[string]bool
}

// OpenJournal opens (creating) the journal whose results.jsonl is path for
// appending and returns the last result per attempt it holds.
func OpenJournal(path string) (*Journal, map[Key]Result, error) {
	eventsPath := filepath.Join(filepath.Dir(path), EventsFile)
	results, err := readLines(path, decodeResult)
	if err != nil {
		return nil, nil, err
	}
	events, err := readLines(eventsPath, decodeEvent)
	if err != nil {
		return nil, nil, err
	}
	if !events.exists && results.exists {
		// An older osmo's run: its events are its results.
		for _, r := range results.items {
			events.items = append(events.items, eventOf(r))
		}
		if err := WriteFileAtomic(eventsPath, jsonLines(events.items)); err != nil {
			return nil, nil, err
		}
		events.whole = -1 // written whole just now
	}
	byID := make(map[string]Result, len(results.items))
	for _, r := range results.items {
		byID[r.RolloutID] = r
	}
	ordered := make([]Result, 0, len(events.items))
	for _, e := range events.items {
		r, ok := byID[e.RolloutID]
		if !ok || r.Key() != (Key{e.RowIndex, e.RunIndex}) {
			r = e.result()
		}
		ordered = append(ordered, r)
	}
	if !slices.EqualFunc(ordered, results.items, func(a, b Result) bool { return a.RolloutID == b.RolloutID }) {
		// A result never acknowledged, or results missing: results.jsonl
		// is rewritten to match the events.
		if err := WriteFileAtomic(path, jsonLines(ordered)); err != nil {
			return nil, nil, err
		}
		results.whole = -1
	}
	j := &Journal{loaded: map[string]bool{}}
	done := map[Key]Result{}
	for _, r := range ordered {
		done[r.Key()] = r
		j.loaded[r.RolloutID] = true
	}
	if j.results, err = openAppend(path, results.whole); err != nil {
		return nil, nil, err
	}
	if j.events, err = openAppend(eventsPath, events.whole); err != nil {
		j.results.Close()
		return nil, nil, err
	}
	return j, done, nil
}

// lines is what a journal file holds.
type lines[T any] struct {
	items  []T
	exists bool
	// whole is the length of its complete lines, where a torn last line is
	// cut off; -1 when the file was just rewritten whole.
	whole int
}

// readLines reads the complete lines of a journal file, refusing a bad one.
func readLines[T any](path string, decode func([]byte) (T, error)) (lines[T], error) {
	var out lines[T]
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return out, fmt.Errorf("eval: journal: %w", err)
	}
	out.exists = true
	out.whole = bytes.LastIndexByte(data, '\n') + 1
	for i, line := range bytes.Split(data[:out.whole], []byte("\n")) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		v, err := decode(line)
		if err != nil {
			return out, fmt.Errorf("eval: journal %s: line %d: %v; move the file away to start over", path, i+1, err)
		}
		out.items = append(out.items, v)
	}
	return out, nil
}

func decodeResult(data []byte) (Result, error) {
	var line struct {
		Result
		// Absent from a line written before rows were selected apart
		// from their file position: the two were the same.
		SourceRowIndex *int `json:"source_row_index"`
	}
	if json.Unmarshal(data, &line) != nil || line.RolloutID == "" {
		return line.Result, errors.New("not a result")
	}
	r := line.Result
	r.SourceRowIndex = r.RowIndex
	if line.SourceRowIndex != nil {
		r.SourceRowIndex = *line.SourceRowIndex
	}
	switch r.Status {
	case statusFailureOld:
		r.Status = StatusFailed
	case StatusSuccess, StatusFailed, StatusSkipped:
	default:
		return r, fmt.Errorf("status %q is not success, failed or skipped", r.Status)
	}
	if r.Messages == nil {
		r.Messages = []map[string]any{}
	}
	return r, nil
}

// openAppend opens path for appending at whole, cutting off what follows.
func openAppend(path string, whole int) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("eval: journal: %w", err)
	}
	if whole >= 0 {
		if err := f.Truncate(int64(whole)); err != nil {
			f.Close()
			return nil, fmt.Errorf("eval: journal: dropping a torn last line: %w", err)
		}
	}
	if _, err := f.Seek(0, 2); err != nil {
		f.Close()
		return nil, fmt.Errorf("eval: journal: %w", err)
	}
	return f, nil
}

// Append writes r durably: its result line, then its event.
func (j *Journal) Append(r Result) error {
	line, err := marshalLine(r)
	if err != nil {
		return fmt.Errorf("eval: journal: %w", err)
	}
	ev, err := marshalLine(eventOf(r))
	if err != nil {
		return fmt.Errorf("eval: journal: %w", err)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	files := []*os.File{j.results, j.events}
	var at [2]int64
	for i, f := range files {
		if at[i], err = f.Seek(0, 1); err != nil {
			return fmt.Errorf("eval: journal: %w", err)
		}
	}
	for i, data := range [][]byte{line, ev} {
		if _, err = files[i].Write(data); err == nil {
			if err = files[i].Sync(); err != nil {
				err = fmt.Errorf("fsync: %w", err)
			}
		}
		if err != nil {
			// Not durable, and not acknowledged: cut what was written, so
			// the next line does not follow a partial one.
			for i, f := range files {
				_ = f.Truncate(at[i])
				_, _ = f.Seek(at[i], 0)
			}
			return fmt.Errorf("eval: journal: %w", err)
		}
	}
	return nil
}

// Carried reports whether r was read when the journal was opened (the
// SDK's resumed).
func (j *Journal) Carried(r Result) bool { return j != nil && j.loaded[r.RolloutID] }

// Close closes the journal's files.
func (j *Journal) Close() error {
	return errors.Join(j.results.Close(), j.events.Close())
}
