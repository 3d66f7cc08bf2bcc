package rollout

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// The event logs are one JSONL file per rollout under
// DIR/<unix-time-of-start>/rollout-<id>.jsonl (the Osmosis --log layout).

// makeLogDir makes the event log directory under root ("" when root is).
// Its files hold whole conversations: readable by their owner only.
func makeLogDir(root string, start time.Time) (string, error) {
	if root == "" {
		return "", nil
	}
	dir := filepath.Join(root, fmt.Sprint(start.Unix()))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("rollout: event log dir: %w", err)
	}
	return dir, nil
}

// openEventLog returns the log of one rollout in dir; without a dir it
// discards events.
func openEventLog(dir, rolloutID string) *eventLog {
	if dir == "" {
		return &eventLog{rolloutID: rolloutID}
	}
	return &eventLog{rolloutID: rolloutID, path: filepath.Join(dir, logFileName(rolloutID))}
}

const (
	// maxFileName is the longest file name (in bytes) most file systems take.
	maxFileName = 255
	// maxHashedPrefix bounds the readable part of a hashed file name.
	maxHashedPrefix = 128
	// hashHex is how many hex digits of the id's SHA-256 a hashed name carries.
	hashHex = 16
)

// logFileName is the event log file of a rollout id. An id made only of
// letters, digits, '-', '_' and '.' that fits in a file name keeps the Osmosis
// name rollout-<id>.jsonl. Any other id gets its sanitized, length-capped
// prefix, a '~' and a hash of the whole id: rollout-<prefix>~<hash>.jsonl.
// No plain name holds a '~', so distinct ids never share a file, and every
// id, however long or whatever it holds, gets a name the file system takes.
func logFileName(id string) string {
	const prefix, suffix = "rollout-", ".jsonl"
	name := sanitizeFileName(id)
	if len(prefix)+len(id)+len(suffix) <= maxFileName && name == id {
		return prefix + id + suffix
	}
	sum := sha256.Sum256([]byte(id))
	if len(name) > maxHashedPrefix {
		name = name[:maxHashedPrefix]
	}
	return prefix + name + "~" + hex.EncodeToString(sum[:])[:hashHex] + suffix
}

// sanitizeFileName replaces every character but letters, digits, '-', '_'
// and '.' (and every byte of invalid UTF-8) with '_'; the result is ASCII.
func sanitizeFileName(id string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' {
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
	maps.Copy(rec, data)
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
		l.f, l.err = os.OpenFile(l.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
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
