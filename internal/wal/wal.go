// Package wal is an append-only, fsync'd log of opaque entries: what a
// service writes before it acknowledges something it must not forget
// across a crash.
//
// Each entry is framed by its length and a CRC-32C of its bytes. Appends
// from many goroutines are written and synced together (group commit), so
// a thousand concurrent appends cost one fsync, not a thousand, and each
// Append returns only once its entry is on disk. Opening a log reads every
// whole entry back; a tail that is not one (the entry a crash cut short, or
// bytes that fail their checksum) is cut off, kept aside in a file of its
// own and reported, never fatal. Rewrite replaces the log with fewer
// entries atomically (write, fsync, rename, fsync the directory), which is
// how the owner compacts it.
package wal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// MaxEntry bounds one entry: a length past it is corruption, not an entry.
const MaxEntry = 64 << 20

// header is an entry's frame: its length and the CRC-32C of its bytes,
// little-endian.
const header = 8

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrClosed is returned by Append and Rewrite on a closed log.
var ErrClosed = errors.New("wal: closed")

// Recovery reports what Open found.
type Recovery struct {
	// Entries is the number of whole entries read.
	Entries int
	// Cut is the bytes after the last whole entry that were dropped (0 for
	// a clean log), Offset where they began and Reason why they are not
	// an entry; SavedTo is the file they were copied to.
	Cut     int64
	Offset  int64
	Reason  string
	SavedTo string
}

// Log is an open log. Its methods are safe for concurrent use.
type Log struct {
	path string
	perm os.FileMode

	reqs chan appendReq
	done chan struct{}

	// mu guards f and size against Rewrite, which swaps the file while
	// the writer is paused.
	mu     sync.Mutex
	f      *os.File
	size   int64
	closed bool
}

type appendReq struct {
	entries [][]byte
	errc    chan error // nil: nobody waits (Enqueue)
}

// Open opens the log at path, creating it (and its directory) with perm
// when missing, and returns the entries it holds in the order they were
// appended.
func Open(path string, perm os.FileMode) (*Log, [][]byte, Recovery, error) {
	var rec Recovery
	if err := os.MkdirAll(filepath.Dir(path), dirPerm(perm)); err != nil {
		return nil, nil, rec, fmt.Errorf("wal: %w", err)
	}
	data, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, nil, rec, fmt.Errorf("wal: %w", err)
	}
	entries, whole, reason := decode(data)
	rec.Entries = len(entries)
	if whole < int64(len(data)) {
		rec.Cut, rec.Offset, rec.Reason = int64(len(data))-whole, whole, reason
		rec.SavedTo = fmt.Sprintf("%s.cut-%s", path, time.Now().UTC().Format("20060102T150405.000000000Z"))
		if err := os.WriteFile(rec.SavedTo, data[whole:], perm); err != nil {
			rec.SavedTo = ""
		}
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, perm)
	if err != nil {
		return nil, nil, rec, fmt.Errorf("wal: %w", err)
	}
	if err := f.Truncate(whole); err != nil {
		f.Close()
		return nil, nil, rec, fmt.Errorf("wal: cutting the torn tail: %w", err)
	}
	if _, err := f.Seek(whole, io.SeekStart); err != nil {
		f.Close()
		return nil, nil, rec, fmt.Errorf("wal: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return nil, nil, rec, fmt.Errorf("wal: %w", err)
	}
	l := &Log{path: path, perm: perm, f: f, size: whole, reqs: make(chan appendReq, 1024), done: make(chan struct{})}
	go l.writer()
	return l, entries, rec, nil
}

// decode reads whole entries from data; whole is where the last one ends
// and reason why what follows is not an entry.
func decode(data []byte) (entries [][]byte, whole int64, reason string) {
	off := 0
	for off < len(data) {
		if len(data)-off < header {
			return entries, int64(off), fmt.Sprintf("%d bytes, too short for an entry's header", len(data)-off)
		}
		n := binary.LittleEndian.Uint32(data[off:])
		sum := binary.LittleEndian.Uint32(data[off+4:])
		if n > MaxEntry {
			return entries, int64(off), fmt.Sprintf("entry length %d is past the %d limit", n, MaxEntry)
		}
		if len(data)-off-header < int(n) {
			return entries, int64(off), fmt.Sprintf("entry of %d bytes cut short at %d", n, len(data)-off-header)
		}
		body := data[off+header : off+header+int(n)]
		if crc32.Checksum(body, castagnoli) != sum {
			return entries, int64(off), "checksum mismatch"
		}
		entries = append(entries, body)
		off += header + int(n)
	}
	return entries, int64(off), ""
}

func dirPerm(perm os.FileMode) os.FileMode {
	// Whoever may read the files may list the directory.
	return perm | (perm&0o444)>>2
}

// Append writes entries and returns once they are on disk (written and
// fsync'd), together with whatever other appends were waiting.
func (l *Log) Append(entries ...[]byte) error {
	for _, e := range entries {
		if len(e) > MaxEntry {
			return fmt.Errorf("wal: entry of %d bytes is past the %d limit", len(e), MaxEntry)
		}
	}
	req := appendReq{entries: entries, errc: make(chan error, 1)}
	select {
	case <-l.done:
		return ErrClosed
	default:
	}
	select {
	case l.reqs <- req:
	case <-l.done:
		return ErrClosed
	}
	select {
	case err := <-req.errc:
		return err
	case <-l.done:
		// Close waits for the batch in flight; a request it did not take
		// was not written.
		select {
		case err := <-req.errc:
			return err
		default:
			return ErrClosed
		}
	}
}

// Enqueue hands entries to the writer and returns without waiting for
// them: they are written, in order with every other append, in the next
// batch, and are on disk once any later Append returns. For entries whose
// loss in a crash costs little (a mark that something was done, which a
// restart would otherwise redo), it spares the caller an fsync. Errors
// other than a closed log or an oversized entry are not reported.
func (l *Log) Enqueue(entries ...[]byte) error {
	for _, e := range entries {
		if len(e) > MaxEntry {
			return fmt.Errorf("wal: entry of %d bytes is past the %d limit", len(e), MaxEntry)
		}
	}
	select {
	case <-l.done:
		return ErrClosed
	default:
	}
	select {
	case l.reqs <- appendReq{entries: entries}:
		return nil
	case <-l.done:
		return ErrClosed
	}
}

// writer takes every append waiting, writes them in one write and syncs
// once, then answers them all.
func (l *Log) writer() {
	var buf bytes.Buffer
	for {
		var batch []appendReq
		select {
		case req := <-l.reqs:
			batch = append(batch, req)
		case <-l.done:
			return
		}
	drain:
		for {
			select {
			case req := <-l.reqs:
				batch = append(batch, req)
			default:
				break drain
			}
		}
		buf.Reset()
		for _, req := range batch {
			for _, e := range req.entries {
				frame(&buf, e)
			}
		}
		err := l.write(buf.Bytes())
		for _, req := range batch {
			if req.errc != nil {
				req.errc <- err
			}
		}
	}
}

// frame appends e to buf with its header.
func frame(buf *bytes.Buffer, e []byte) {
	var h [header]byte
	binary.LittleEndian.PutUint32(h[:], uint32(len(e)))
	binary.LittleEndian.PutUint32(h[4:], crc32.Checksum(e, castagnoli))
	buf.Write(h[:])
	buf.Write(e)
}

func (l *Log) write(p []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	if _, err := l.f.Write(p); err != nil {
		// A partial write would leave a torn entry in the middle of the
		// log: cut back to the last whole one.
		_ = l.f.Truncate(l.size)
		_, _ = l.f.Seek(l.size, io.SeekStart)
		return fmt.Errorf("wal: %w", err)
	}
	if err := l.f.Sync(); err != nil {
		return fmt.Errorf("wal: %w", err)
	}
	l.size += int64(len(p))
	return nil
}

// Size is the log's length in bytes.
func (l *Log) Size() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.size
}

// Rewrite replaces the log's content with what keep returns when given
// the entries it holds now; appends wait meanwhile. The new log is written
// beside the old one and renamed over it, so a crash leaves one or the
// other, whole.
func (l *Log) Rewrite(keep func(entries [][]byte) [][]byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	data, err := os.ReadFile(l.path)
	if err != nil {
		return fmt.Errorf("wal: rewrite: %w", err)
	}
	entries, _, _ := decode(data[:l.size])
	var buf bytes.Buffer
	for _, e := range keep(entries) {
		frame(&buf, e)
	}
	tmp := l.path + ".rewrite"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, l.perm)
	if err != nil {
		return fmt.Errorf("wal: rewrite: %w", err)
	}
	if _, err := f.Write(buf.Bytes()); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("wal: rewrite: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("wal: rewrite: %w", err)
	}
	if err := os.Rename(tmp, l.path); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("wal: rewrite: %w", err)
	}
	syncDir(filepath.Dir(l.path))
	l.f.Close()
	l.f, l.size = f, int64(buf.Len())
	return nil
}

// syncDir makes a rename in dir durable.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
}

// Close stops the log once what was appended or enqueued before it is on
// disk. Appends after it fail with ErrClosed.
func (l *Log) Close() error {
	// An empty append waits for every entry queued before it (Enqueue's
	// included) to be written and synced.
	_ = l.Append()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.done)
	err := l.f.Close()
	l.mu.Unlock()
	return err
}
