package execagent

import (
	"bytes"
	"strings"
)

// lastLine keeps the last non-empty line written to it, in at most two
// buffers of max bytes: a longer line is skipped as it streams by, never
// buffered, so a flooding program costs no memory and never blocks on a full
// pipe.
type lastLine struct {
	max int
	// cur is the line being read; curTooLong once it passed max.
	cur        []byte
	curTooLong bool
	// last is the last complete non-empty line; lastTooLong when that line
	// was skipped for its length.
	last        []byte
	lastTooLong bool
}

func (l *lastLine) Write(p []byte) (int, error) {
	splitLines(p, l.add, l.endLine)
	return len(p), nil
}

// splitLines hands p to add piece by piece, calling end at every newline:
// a line may span writes.
func splitLines(p []byte, add func([]byte), end func()) {
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			add(p)
			return
		}
		add(p[:i])
		end()
		p = p[i+1:]
	}
}

func (l *lastLine) add(b []byte) {
	if l.curTooLong || len(b) == 0 {
		return
	}
	if len(l.cur)+len(b) > l.max {
		l.curTooLong, l.cur = true, l.cur[:0]
		return
	}
	l.cur = append(l.cur, b...)
}

func (l *lastLine) endLine() {
	switch {
	case l.curTooLong:
		l.last, l.lastTooLong = l.last[:0], true
	case len(bytes.TrimSpace(l.cur)) > 0:
		// Swap rather than copy: the old last line's buffer takes the next line.
		l.last, l.cur = l.cur, l.last
		l.lastTooLong = false
	}
	l.cur, l.curTooLong = l.cur[:0], false
}

// finish ends a final line that has no newline.
func (l *lastLine) finish() {
	if len(l.cur) > 0 || l.curTooLong {
		l.endLine()
	}
}

// stderrLines splits stderr into lines for the logs, each cut to lineMax
// bytes, and keeps the last tailMax bytes of the raw stream.
type stderrLines struct {
	emit    func(line string, dropped int)
	lineMax int
	cur     []byte
	dropped int
	tailMax int
	tail    []byte
}

func (s *stderrLines) Write(p []byte) (int, error) {
	s.keepTail(p)
	splitLines(p, s.add, s.endLine)
	return len(p), nil
}

func (s *stderrLines) keepTail(p []byte) {
	if len(p) >= s.tailMax {
		s.tail = append(s.tail[:0], p[len(p)-s.tailMax:]...)
		return
	}
	// Let the buffer reach twice the tail before moving it down, so the copy
	// is amortised over many writes.
	if len(s.tail)+len(p) > 2*s.tailMax {
		keep := s.tailMax - len(p)
		s.tail = append(s.tail[:0], s.tail[len(s.tail)-keep:]...)
	}
	s.tail = append(s.tail, p...)
}

func (s *stderrLines) add(b []byte) {
	room := s.lineMax - len(s.cur)
	if len(b) > room {
		s.dropped += len(b) - room
		b = b[:room]
	}
	s.cur = append(s.cur, b...)
}

func (s *stderrLines) endLine() {
	line := strings.TrimSuffix(string(s.cur), "\r")
	if line != "" || s.dropped > 0 {
		s.emit(line, s.dropped)
	}
	s.cur, s.dropped = s.cur[:0], 0
}

func (s *stderrLines) finish() {
	if len(s.cur) > 0 || s.dropped > 0 {
		s.endLine()
	}
}

// Tail is the last tailMax bytes of stderr, as valid UTF-8 (the cut may
// fall inside a character).
func (s *stderrLines) Tail() string {
	t := s.tail
	if len(t) > s.tailMax {
		t = t[len(t)-s.tailMax:]
	}
	return strings.ToValidUTF8(string(t), "\uFFFD")
}
