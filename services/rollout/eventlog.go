package rollout

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// eventLogs writes one JSONL file of events per rollout under
// DIR/<unix-time-of-start>/rollout-<id>.jsonl (the Osmosis --log layout).
type eventLogs struct {
	dir string // "" disables logging
}

func newEventLogs(root string, start time.Time) (*eventLogs, error) {
	if root == "" {
		return &eventLogs{}, nil
	}
	dir := filepath.Join(root, fmt.Sprint(start.Unix()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("rollout: event log dir: %w", err)
	}
	return &eventLogs{dir: dir}, nil
}

// open returns the log of one rollout; a disabled log discards events.
func (l *eventLogs) open(rolloutID string) *eventLog {
	if l.dir == "" {
		return &eventLog{rolloutID: rolloutID}
	}
	return &eventLog{rolloutID: rolloutID, path: filepath.Join(l.dir, "rollout-"+safeFileName(rolloutID)+".jsonl")}
}

// safeFileName keeps a rollout id usable as a file name on any system.
func safeFileName(id string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			return r
		}
		return '_'
	}, id)
}

type eventLog struct {
	rolloutID string
	path      string

	mu  sync.Mutex
	f   *os.File
	err error
}

// write appends one event. Logging is best effort: a failing disk never fails
// a rollout, and the first error is kept for close to report.
func (l *eventLog) write(event string, data map[string]any) {
	if l == nil || l.path == "" {
		return
	}
	rec := make(map[string]any, len(data)+3)
	for k, v := range data {
		rec[k] = v
	}
	rec["event"] = event
	rec["rollout_id"] = l.rolloutID
	rec["ts"] = time.Now().UTC().Format(time.RFC3339Nano)
	line, err := json.Marshal(rec)
	if err != nil {
		line, _ = json.Marshal(map[string]any{"event": event, "rollout_id": l.rolloutID, "encode_error": err.Error()})
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return
	}
	if l.f == nil {
		l.f, l.err = os.OpenFile(l.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if l.err != nil {
			return
		}
	}
	_, l.err = l.f.Write(append(line, '\n'))
}

func (l *eventLog) close() error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f != nil {
		if err := l.f.Close(); err != nil && l.err == nil {
			l.err = err
		}
		l.f = nil
	}
	return l.err
}
