// Package rolloutproc starts an Osmosis rollout server (a Python rollout's
// entrypoint, as `osmosis eval run` starts it) as a child process and
// watches it.
//
// As the SDK does: in the rollout directory, `uv sync --project DIR` and
// then `uv run --no-sync --project DIR ENTRYPOINT` when uv is on PATH, else
// `python3 ENTRYPOINT`. The child's environment is the parent's minus
// VIRTUAL_ENV, then Spec.Env, then _OSMOSIS_ROLLOUT_PORT (a free loopback
// port), _OSMOSIS_ROLLOUT_ARTIFACT_ROOT, _OSMOSIS_ROLLOUT_INSTANCE_ID (random)
// and PYTHONUNBUFFERED=1. It runs in a process group of its own; the whole
// group is killed when it is stopped, when the context given to Start ends,
// and once its leader exits (nothing it spawned outlives it). It is ready
// when GET /health answers 200 (and, when the answer names an instance id,
// it is this one's).
package rolloutproc

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
)

// Defaults of Spec.
const (
	DefaultEntrypoint   = "main.py"
	DefaultReadyTimeout = 90 * time.Second
	DefaultStopGrace    = 5 * time.Second
	// HealthInterval is how often /health is polled while starting.
	HealthInterval = 200 * time.Millisecond
)

// InstanceHeader is the /health answer header in which the SDK's bootstrap
// names the instance (the body's "instance_id" says the same).
const InstanceHeader = "x-osmosis-rollout-instance-id"

// Redacted replaces every secret in the captured output.
const Redacted = "[REDACTED]"

const (
	tailLines = 30       // output lines errors carry
	maxLine   = 64 << 10 // longest line passed on; the rest is cut
)

// Spec describes a rollout server to start.
type Spec struct {
	// Dir is the rollout directory (rollouts/NAME); the process runs there.
	Dir string
	// Entrypoint is the file to run, relative to Dir; default "main.py".
	Entrypoint string
	// Env is laid over the parent's environment ([env], then secrets).
	Env map[string]string
	// Withhold names variables of the parent's environment not passed on
	// (VIRTUAL_ENV never is).
	Withhold []string
	// Secrets are values to replace with [REDACTED] in the output.
	Secrets []string
	// ArtifactRoot is _OSMOSIS_ROLLOUT_ARTIFACT_ROOT; "" means a temporary
	// directory, removed once the process exited.
	ArtifactRoot string
	// Output receives the process's stdout and stderr, a line per Write
	// (ending in "\n"), secrets redacted. nil discards it.
	Output io.Writer
	// ReadyTimeout bounds the wait for /health; default 90s.
	ReadyTimeout time.Duration
	// StopGrace is how long SIGTERM has before SIGKILL; default 5s.
	StopGrace time.Duration
	// Logger receives start and exit records; nil means slog.Default().
	Logger *slog.Logger
}

// StartError is a server that did not become ready.
type StartError struct {
	// Reason says what happened ("exited with status 1 before answering
	// /health", "not healthy within 90s", ...).
	Reason string
	// Err is the underlying error, if any.
	Err error
	// Tail is the end of the process's output, secrets redacted.
	Tail string
}

func (e *StartError) Error() string {
	msg := "rollout server: " + e.Reason
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	if t := strings.TrimSpace(e.Tail); t != "" {
		return msg + "; its output ends with:\n" + t
	}
	return msg + " (it printed nothing)"
}

func (e *StartError) Unwrap() error { return e.Err }

// ExitError is how a server process ended other than by exiting 0.
type ExitError struct {
	// Code is the exit status; -1 when a signal ended it.
	Code int
	// Signal names that signal (SIGKILL).
	Signal string
	// Stopped: Stop was called (or Start's context ended) before it exited.
	Stopped bool
	// Tail is the end of its output, secrets redacted.
	Tail string
}

func (e *ExitError) Error() string {
	how := fmt.Sprintf("exited with status %d", e.Code)
	if e.Signal != "" {
		how = "killed by signal " + e.Signal
	}
	if e.Stopped {
		how += " after it was stopped"
	}
	return "rollout server " + how
}

// lineWriter passes output on a line at a time, secrets redacted, keeping
// the last lines for errors.
type lineWriter struct {
	w       io.Writer
	secrets []string

	mu      sync.Mutex
	partial []byte
	last    []string
}

func newLineWriter(w io.Writer, secrets []string) *lineWriter {
	keep := slices.DeleteFunc(slices.Clone(secrets), func(s string) bool { return s == "" })
	// Longest first, so a secret containing another is replaced whole.
	slices.SortFunc(keep, func(a, b string) int { return len(b) - len(a) })
	return &lineWriter{w: w, secrets: keep}
}

// Write splits p into lines; a line longer than maxLine is cut.
func (l *lineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(p)
	for len(p) > 0 {
		line, rest, full := bytes.Cut(p, []byte{'\n'})
		room := max(maxLine-len(l.partial), 0)
		l.partial = append(l.partial, line[:min(len(line), room)]...)
		if full {
			l.emit()
		}
		p = rest
	}
	return n, nil
}

// flush emits an unterminated last line.
func (l *lineWriter) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.partial) > 0 {
		l.emit()
	}
}

// emit passes l.partial on as one line. Caller holds mu.
func (l *lineWriter) emit() {
	line := strings.TrimRight(string(l.partial), "\r")
	l.partial = l.partial[:0]
	for _, s := range l.secrets {
		line = strings.ReplaceAll(line, s, Redacted)
	}
	if len(l.last) == tailLines {
		l.last = append(l.last[:0], l.last[1:]...)
	}
	l.last = append(l.last, line)
	if l.w != nil {
		_, _ = io.WriteString(l.w, line+"\n")
	}
}

func (l *lineWriter) tail() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.last, "\n")
}
