package grader

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
)

// journal is an append-only JSON Lines file of gradings, one per line.
// Each append is fsync'd before the grading is answered, so an answer the
// client saw is never forgotten by a restarted service. A crash mid-append
// leaves at most a torn last line, which loading ignores.
type journal struct {
	path       string
	compactMin int
	log        *slog.Logger

	mu     sync.Mutex
	closed bool
	f      *os.File // nil after a failed reopen; the next append retries
	size   int64    // bytes of whole lines in the file
	lines  int
}

// loadJournal reads the gradings in path (none if it does not exist). It
// skips lines that do not parse: a torn last line is the expected trace of a
// crash; a bad line elsewhere is corruption, logged as an error.
func loadJournal(path string, log *slog.Logger) ([]*grading, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	defer f.Close()
	var out []*grading
	r := bufio.NewReader(f)
	for lineNo := 1; ; lineNo++ {
		line, rerr := r.ReadBytes('\n')
		if rerr != nil && !errors.Is(rerr, io.EOF) {
			return nil, fmt.Errorf("journal: read %s: %w", path, rerr)
		}
		if line = bytes.TrimSpace(line); len(line) > 0 {
			g := new(grading)
			err := json.Unmarshal(line, g)
			if err == nil && g.RolloutID == "" {
				err = errors.New("no rollout_id")
			}
			switch {
			case err == nil:
				out = append(out, g)
			case errors.Is(rerr, io.EOF):
				log.Warn("journal: ignoring torn last line", "path", path, "line", lineNo, "error", err)
			default:
				log.Error("journal: skipping corrupt line; its samples may be graded again", "path", path, "line", lineNo, "error", err)
			}
		}
		if rerr != nil {
			return out, nil
		}
	}
}

func newJournal(path string, compactMin int, log *slog.Logger) (*journal, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	return &journal{path: path, compactMin: compactMin, log: log}, nil
}

// append writes g and fsyncs it, then calls then while still holding the
// journal lock, whether or not the write succeeded. Callers publish g in
// then, so a compaction (which also holds the lock) sees g either in the
// store or not at all and never drops it.
func (j *journal) append(g *grading, then func()) error {
	line, err := json.Marshal(g)
	j.mu.Lock()
	defer j.mu.Unlock()
	defer then()
	if err != nil {
		return fmt.Errorf("journal: encode: %w", err)
	}
	if j.closed {
		return fmt.Errorf("journal: %s is closed", j.path)
	}
	if j.f == nil {
		if err := j.reopen(); err != nil {
			return err
		}
	}
	line = append(line, '\n')
	if _, err := j.f.Write(line); err != nil {
		// Cut a partial line off, or the next record would be glued to it.
		_ = j.f.Truncate(j.size)
		return fmt.Errorf("journal: write %s: %w", j.path, err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("journal: sync %s: %w", j.path, err)
	}
	j.size += int64(len(line))
	j.lines++
	return nil
}

func (j *journal) reopen() error {
	f, err := os.OpenFile(j.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("journal: open %s: %w", j.path, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("journal: stat %s: %w", j.path, err)
	}
	j.f, j.size = f, st.Size()
	return nil
}

// needsCompaction reports whether the file holds enough stale lines, given
// live gradings in memory, to be worth rewriting: at least compactMin and
// more than live, which keeps rewriting linear in the lines appended.
func (j *journal) needsCompaction(live int) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	stale := j.lines - live
	return stale >= j.compactMin && stale > live
}

// compact rewrites the journal with the gradings live returns: written to a
// temporary file, fsync'd, renamed over the journal, then the directory is
// fsync'd so the rename itself survives a crash.
func (j *journal) compact(live func() []*grading) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return fmt.Errorf("journal: %s is closed", j.path)
	}
	gs := live()
	tmp := j.path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("journal: compact: %w", err)
	}
	w := bufio.NewWriter(f)
	enc := json.NewEncoder(w)
	for _, g := range gs {
		if err = enc.Encode(g); err != nil {
			break
		}
	}
	if err == nil {
		err = w.Flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, j.path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("journal: compact %s: %w", j.path, err)
	}
	if err := syncDir(filepath.Dir(j.path)); err != nil {
		j.log.Warn("journal: could not sync its directory after compaction", "path", j.path, "error", err)
	}
	// The old handle points at the replaced file: appends must go to the new one.
	if j.f != nil {
		j.f.Close()
		j.f = nil
	}
	j.lines = len(gs)
	return j.reopen()
}

func (j *journal) close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.closed = true
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	if err != nil {
		return fmt.Errorf("journal: close %s: %w", j.path, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
