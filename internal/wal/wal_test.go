package wal

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

func open(t *testing.T, path string) (*Log, [][]byte, Recovery) {
	t.Helper()
	l, entries, rec, err := Open(path, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, entries, rec
}

func TestAppendAndReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state", "log")
	l, entries, rec := open(t, path)
	if len(entries) != 0 || rec.Entries != 0 || rec.Cut != 0 {
		t.Fatalf("new log: %d entries, %+v", len(entries), rec)
	}
	// Concurrent appends all land, each whole.
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := l.Append([]byte(fmt.Sprintf("entry-%03d", i)), []byte{}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	size := l.Size()
	l.Close()
	if err := l.Append([]byte("late")); err != ErrClosed {
		t.Errorf("append after close = %v, want ErrClosed", err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 || st.Size() != size {
		t.Errorf("file mode %v size %d, want 0600 and %d", st.Mode().Perm(), st.Size(), size)
	}
	_, entries, rec = open(t, path)
	if len(entries) != 400 || rec.Cut != 0 {
		t.Fatalf("reopened: %d entries (want 400), %+v", len(entries), rec)
	}
	seen := map[string]bool{}
	for _, e := range entries {
		seen[string(e)] = true
	}
	for i := range 200 {
		if !seen[fmt.Sprintf("entry-%03d", i)] {
			t.Errorf("entry-%03d lost", i)
		}
	}
}

// TestTornAndCorruptTails: whatever follows the last whole entry is cut
// off, kept aside and reported; the log goes on from there.
func TestTornAndCorruptTails(t *testing.T) {
	whole := func(t *testing.T) (string, []byte) {
		path := filepath.Join(t.TempDir(), "log")
		l, _, _ := open(t, path)
		for _, e := range []string{"one", "two", "three"} {
			if err := l.Append([]byte(e)); err != nil {
				t.Fatal(err)
			}
		}
		l.Close()
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return path, data
	}
	cases := map[string]func(data []byte) []byte{
		"header cut short": func(d []byte) []byte { return d[:len(d)-len("three")-header+3] },
		"body cut short":   func(d []byte) []byte { return d[:len(d)-2] },
		"flipped bit":      func(d []byte) []byte { d = bytes.Clone(d); d[len(d)-1] ^= 1; return d },
		"huge length":      func(d []byte) []byte { d = bytes.Clone(d); d[len(d)-len("three")-header+3] = 0x7f; return d },
		"garbage appended": func(d []byte) []byte { return append(bytes.Clone(d), "three"...) },
	}
	for name, damage := range cases {
		t.Run(name, func(t *testing.T) {
			path, data := whole(t)
			bad := damage(data)
			if err := os.WriteFile(path, bad, 0o600); err != nil {
				t.Fatal(err)
			}
			l, entries, rec := open(t, path)
			want := 3
			if name != "garbage appended" {
				want = 2
			}
			if len(entries) != want || rec.Entries != want || rec.Cut == 0 || rec.Reason == "" {
				t.Fatalf("%d entries (want %d), recovery %+v", len(entries), want, rec)
			}
			saved, err := os.ReadFile(rec.SavedTo)
			if err != nil || !bytes.Equal(saved, bad[rec.Offset:]) || int64(len(saved)) != rec.Cut {
				t.Errorf("the cut tail was not kept aside: %v", err)
			}
			// Appending goes on from the last whole entry.
			if err := l.Append([]byte("four")); err != nil {
				t.Fatal(err)
			}
			l.Close()
			_, entries, rec = open(t, path)
			if len(entries) != want+1 || string(entries[want]) != "four" || rec.Cut != 0 {
				t.Errorf("after the repair: %q, %+v", entries, rec)
			}
		})
	}
}

func TestRewrite(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	l, _, _ := open(t, path)
	for i := range 100 {
		if err := l.Append([]byte(fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	before := l.Size()
	err := l.Rewrite(func(entries [][]byte) [][]byte {
		if len(entries) != 100 {
			t.Errorf("rewrite saw %d entries, want 100", len(entries))
		}
		return entries[90:]
	})
	if err != nil {
		t.Fatal(err)
	}
	if l.Size() >= before {
		t.Errorf("size %d after the rewrite, %d before", l.Size(), before)
	}
	if err := l.Append([]byte("after")); err != nil {
		t.Fatal(err)
	}
	l.Close()
	_, entries, rec := open(t, path)
	if len(entries) != 11 || string(entries[0]) != "90" || string(entries[10]) != "after" || rec.Cut != 0 {
		t.Fatalf("after the rewrite: %q %+v", entries, rec)
	}
	if _, err := os.Stat(path + ".rewrite"); !os.IsNotExist(err) {
		t.Errorf("the rewrite's temporary file is left: %v", err)
	}
}

func TestEntryLimit(t *testing.T) {
	l, _, _ := open(t, filepath.Join(t.TempDir(), "log"))
	if err := l.Append(make([]byte, MaxEntry+1)); err == nil {
		t.Error("an entry past MaxEntry was taken")
	}
}

// FuzzDecode: no bytes on disk crash Open's reader, and what it reads back
// is a prefix of the data, each entry whole.
func FuzzDecode(f *testing.F) {
	var buf bytes.Buffer
	frame(&buf, []byte("one"))
	frame(&buf, []byte(`{"op":"accepted","id":"r1"}`))
	f.Add(buf.Bytes())
	f.Add([]byte{})
	f.Add([]byte{1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		entries, whole, reason := decode(data)
		if whole > int64(len(data)) || (whole < int64(len(data))) != (reason != "") {
			t.Fatalf("whole %d of %d, reason %q", whole, len(data), reason)
		}
		var again bytes.Buffer
		for _, e := range entries {
			frame(&again, e)
		}
		if !bytes.Equal(again.Bytes(), data[:whole]) {
			t.Fatal("the entries read do not re-encode to the bytes they came from")
		}
	})
}

// TestEnqueue: entries handed over without waiting are written in order
// with the appends around them, on disk once a later Append returns, and
// written before Close returns.
func TestEnqueue(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	l, _, _ := open(t, path)
	for i := range 100 {
		if err := l.Enqueue([]byte(fmt.Sprintf("mark-%03d", i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Append([]byte("sync")); err != nil {
		t.Fatal(err)
	}
	if err := l.Enqueue([]byte("last")); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if err := l.Enqueue([]byte("late")); err != ErrClosed {
		t.Errorf("enqueue after close = %v, want ErrClosed", err)
	}
	_, entries, rec := open(t, path)
	if len(entries) != 102 || rec.Cut != 0 {
		t.Fatalf("reopened with %d entries (%+v), want 102", len(entries), rec)
	}
	for i, e := range entries[:100] {
		if want := fmt.Sprintf("mark-%03d", i); string(e) != want {
			t.Fatalf("entry %d = %q, want %q", i, e, want)
		}
	}
	if string(entries[100]) != "sync" || string(entries[101]) != "last" {
		t.Errorf("last entries %q %q, want sync, last", entries[100], entries[101])
	}
}
