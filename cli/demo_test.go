package cli_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/cli"
)

// lastWrite is a buffer that remembers when it was last written to.
type lastWrite struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	last time.Time
}

func (w *lastWrite) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last = time.Now()
	return w.buf.Write(p)
}

// TestDemoExitsPromptly: once the demo has printed its samples it returns
// without waiting on its own servers' shutdown. A connection a client
// opened but never sent a request on holds a server's graceful shutdown
// for net/http's 5 s unless the client closes it, which happened in about
// half the runs; three runs of 20 rollouts must each end well inside that.
func TestDemoExitsPromptly(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the demo three times")
	}
	for i := range 3 {
		var out lastWrite
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		err := cli.Run(ctx, []string{"demo", "-n", "20"}, &out, &out)
		cancel()
		if err != nil {
			t.Fatalf("run %d: %v\n%s", i, err, out.buf.String())
		}
		if gap := time.Since(out.last); gap > 3*time.Second {
			t.Fatalf("run %d: returned %v after its last output, want under 3s", i, gap.Round(time.Millisecond))
		}
	}
}

// TestDemoWithServedAPIKey: OSMO_API_KEY, set for a served osmo, does not
// lock the demo's own controller out of its in-process stack.
func TestDemoWithServedAPIKey(t *testing.T) {
	t.Setenv("OSMO_API_KEY", "a-served-key")
	var out lastWrite
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := cli.Run(ctx, []string{"demo", "-n", "1"}, &out, &out); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.buf.String())
	}
}
