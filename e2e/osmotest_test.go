//go:build unix

package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"
)

const threeRows = `{"user_prompt":"What is 6 times 7?","ground_truth":"42"}
{"user_prompt":"What is 3 times 5?","ground_truth":"16"}
{"user_prompt":"What is 9 times 9?","ground_truth":"81"}
`

// TestOsmoTest: `osmo test` runs rows and prints each conversation and
// reward, offline on the mock policy.
func TestOsmoTest(t *testing.T) {
	data := filepath.Join(t.TempDir(), "rows.jsonl")
	if err := os.WriteFile(data, []byte(threeRows), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, osmoBin, "test", "-d", data, "--workflow", "multiply", "--mock", "--offset", "1").CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	text := string(out)
	for _, want := range []string{
		"── row 1 ──", "user:      What is 3 times 5?", "[calls multiply(", "tool:      15", "→ success, reward 0",
		"── row 2 ──", "What is 9 times 9?", "→ success, reward 1",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
	if strings.Contains(text, "row 0 ") {
		t.Errorf("--offset 1 ran row 0:\n%s", text)
	}
}

// terminal is a process on a pseudo-terminal, read as a person would.
type terminal struct {
	t    *testing.T
	pty  *os.File
	mu   sync.Mutex
	buf  bytes.Buffer
	seen int // how far expect has read
}

func (tm *terminal) read() {
	b := make([]byte, 4096)
	for {
		n, err := tm.pty.Read(b)
		tm.mu.Lock()
		tm.buf.Write(b[:n])
		tm.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// expect waits for want in the output after what was already matched.
func (tm *terminal) expect(want string) {
	tm.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		tm.mu.Lock()
		rest := tm.buf.String()[tm.seen:]
		tm.mu.Unlock()
		if i := strings.Index(rest, want); i >= 0 {
			tm.seen += i + len(want)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	tm.mu.Lock()
	defer tm.mu.Unlock()
	tm.t.Fatalf("never saw %q; output after the last match:\n%s", want, tm.buf.String()[tm.seen:])
}

func (tm *terminal) send(line string) {
	tm.t.Helper()
	if _, err := tm.pty.WriteString(line + "\r"); err != nil {
		tm.t.Fatal(err)
	}
}

// TestOsmoTestInteractive steps through rows on a pseudo-terminal: next
// turn, show messages, show tools, jump to a row, continue and quit.
func TestOsmoTestInteractive(t *testing.T) {
	data := filepath.Join(t.TempDir(), "rows.jsonl")
	if err := os.WriteFile(data, []byte(threeRows), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(osmoBin, "test", "-d", data, "--workflow", "multiply", "--mock", "-i")
	f, err := pty.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	tm := &terminal{t: t, pty: f}
	go tm.read()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = f.Close()
	})

	tm.expect("▶ row 0: What is 6 times 7?")
	tm.expect("row 0, turn 1: the agent asks the model")
	tm.expect("[q]uit > ")
	tm.send("t")
	tm.expect("multiply: ")
	tm.expect("[q]uit > ")
	tm.send("m")
	tm.expect("user:      What is 6 times 7?")
	tm.expect("[q]uit > ")
	tm.send("n")
	tm.expect("row 0, turn 2:")
	tm.expect("last tool: 42")
	tm.expect("[q]uit > ")
	tm.send("c")
	tm.expect("→ success, reward 1")
	tm.expect("▶ row 1:")
	tm.expect("[q]uit > ")
	tm.send("j 2")
	tm.expect("▶ row 2: What is 9 times 9?")
	tm.expect("[q]uit > ")
	tm.send("j 9")
	tm.expect("jump to which row? 0-2")
	tm.send("q")
	tm.expect("quit")
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("osmo test -i ended with %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("osmo test -i did not exit after q")
	}
}
