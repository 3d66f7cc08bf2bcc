package eval

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
)

// Result is one sample attempt's terminal result: a line of results.jsonl.
type Result struct {
	RowIndex  int    `json:"row_index"`
	RunIndex  int    `json:"run_index"`
	RolloutID string `json:"rollout_id"`
	// Status is success, failure or skipped (the grader removed the
	// sample: it is left out of the pass rate).
	Status      string           `json:"status"`
	ErrCategory string           `json:"err_category,omitempty"`
	ErrMessage  string           `json:"err_message,omitempty"`
	Reward      *float64         `json:"reward"`
	LatencyMS   float64          `json:"latency_ms"`
	Tokens      int              `json:"tokens"`
	Messages    []map[string]any `json:"messages"`
	// TraceID is the rollout's trace, when the run traced.
	TraceID string `json:"trace_id,omitempty"`
}

// Result statuses.
const (
	StatusSuccess = "success"
	StatusFailure = "failure"
	StatusSkipped = "skipped"
)

// Key is a sample attempt: a row and a run of it.
type Key struct{ Row, Run int }

// Key is the result's attempt.
func (r Result) Key() Key { return Key{r.RowIndex, r.RunIndex} }

// Journal is results.jsonl: one line per terminal result, each written and
// fsync'd before the rollout is acknowledged, so a run killed at any point
// (kill -9 included) leaves every acknowledged result on disk. A line cut
// short by the kill is ignored when the journal is read again.
type Journal struct {
	mu sync.Mutex
	f  *os.File
}

// OpenJournal opens (creating) the journal at path for appending and
// returns what it already holds: the last result per attempt. A line cut
// short by a crash is cut off the file, so the next one starts clean.
func OpenJournal(path string) (*Journal, map[Key]Result, error) {
	data, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("eval: journal: %w", err)
	}
	whole := bytes.LastIndexByte(data, '\n') + 1
	done := map[Key]Result{}
	for i, line := range bytes.Split(data[:whole], []byte("\n")) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var r Result
		if err := json.Unmarshal(line, &r); err != nil || r.RolloutID == "" {
			return nil, nil, fmt.Errorf("eval: journal %s: line %d is not a result; move the file away to start over", path, i+1)
		}
		done[r.Key()] = r
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, nil, fmt.Errorf("eval: journal: %w", err)
	}
	if whole < len(data) {
		if err := f.Truncate(int64(whole)); err != nil {
			f.Close()
			return nil, nil, fmt.Errorf("eval: journal: dropping a torn last line: %w", err)
		}
	}
	if _, err := f.Seek(int64(whole), 0); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("eval: journal: %w", err)
	}
	return &Journal{f: f}, done, nil
}

// Append writes r durably.
func (j *Journal) Append(r Result) error {
	line, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("eval: journal: %w", err)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, err := j.f.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("eval: journal: %w", err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("eval: journal: fsync: %w", err)
	}
	return nil
}

// Close closes the journal file.
func (j *Journal) Close() error { return j.f.Close() }
