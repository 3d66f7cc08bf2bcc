//go:build unix

package execagent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
	"github.com/osmo-rl/osmo/workflows/execagent"
)

// agentModeEnv makes the test binary act as an exec agent instead of
// running the tests.
const agentModeEnv = "EXECAGENT_TEST_AGENT"

func TestMain(m *testing.M) {
	if mode := os.Getenv(agentModeEnv); mode != "" {
		os.Exit(testAgent(mode))
	}
	os.Exit(m.Run())
}

// testAgent is the test binary run as a program under the exec contract.
func testAgent(mode string) int {
	switch mode {
	case "dump":
		// Hands its environment, stdin and working directory back
		// through extra_fields.
		in, err := io.ReadAll(os.Stdin)
		if err != nil {
			fmt.Fprintln(os.Stderr, "read stdin:", err)
			return 1
		}
		cwd, err := os.Getwd()
		if err != nil {
			fmt.Fprintln(os.Stderr, "getwd:", err)
			return 1
		}
		out, _ := json.Marshal(map[string]any{
			"messages":     []any{map[string]any{"role": "assistant", "content": "dumped"}},
			"extra_fields": map[string]any{"env": os.Environ(), "stdin": string(in), "cwd": cwd},
		})
		fmt.Println(string(out))
		return 0
	case "escape":
		// Leaves a process in a session of its own holding stdout open,
		// writes its pid to $PIDFILE, and exits successfully.
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), agentModeEnv+"=sleep")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			fmt.Fprintln(os.Stderr, "start:", err)
			return 1
		}
		if err := os.WriteFile(os.Getenv("PIDFILE"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o600); err != nil {
			fmt.Fprintln(os.Stderr, "pidfile:", err)
			return 1
		}
		fmt.Println(`{"messages":[{"role":"assistant","content":"escaped"}]}`)
		return 0
	case "sleep":
		time.Sleep(time.Hour)
		return 0
	}
	fmt.Fprintf(os.Stderr, "unknown %s %q\n", agentModeEnv, mode)
	return 2
}

// fakeRuntime is the rollout service's side of a Rollout, recording what
// the workflow logs.
type fakeRuntime struct {
	rolloutID string
	logger    *slog.Logger

	mu     sync.Mutex
	logs   bytes.Buffer
	events []event
}

type event struct {
	name string
	data map[string]any
}

func newRollout(id string) (*fakeRuntime, *osmo.Rollout) {
	rt := &fakeRuntime{rolloutID: id}
	rt.logger = slog.New(slog.NewJSONHandler(lockedWriter{rt}, &slog.HandlerOptions{Level: slog.LevelDebug})).With("rollout_id", id)
	return rt, osmotest.NewRollout(id, rt)
}

func (f *fakeRuntime) Endpoint(sampleID string) osmo.Endpoint {
	return osmo.Endpoint{
		BaseURL: fmt.Sprintf("http://127.0.0.1:1/r/%s/s/%s/v1", f.rolloutID, sampleID),
		APIKey:  "tok-" + f.rolloutID,
		Headers: map[string]string{"x-rollout-id": f.rolloutID, "x-sample-id": sampleID},
	}
}

func (f *fakeRuntime) Logger() *slog.Logger { return f.logger }

func (f *fakeRuntime) RecordToolCall(string, time.Duration) {}

func (f *fakeRuntime) LogEvent(name string, data map[string]any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, event{name, data})
}

func (f *fakeRuntime) Logs() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.logs.String()
}

func (f *fakeRuntime) Events() []event {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]event(nil), f.events...)
}

type lockedWriter struct{ f *fakeRuntime }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.f.mu.Lock()
	defer w.f.mu.Unlock()
	return w.f.logs.Write(p)
}

// run builds cfg's workflow and runs it for one rollout.
func run(t *testing.T, ctx context.Context, cfg execagent.Config, in *osmotest.Input) (*fakeRuntime, *osmo.Rollout, error) {
	t.Helper()
	wf, err := execagent.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	rt, r := newRollout("rollout-1")
	if in == nil {
		in = &osmotest.Input{RolloutID: r.ID, Prompt: []osmo.Message{{"role": "user", "content": "hi"}}}
	}
	err = osmotest.Run(ctx, wf, r, in)
	if t.Failed() || testing.Verbose() {
		t.Logf("logs:\n%s", rt.Logs())
	}
	return rt, r, err
}

func shell(script string, env ...string) execagent.Config {
	return execagent.Config{Command: []string{"sh", "-c", script}, Env: env}
}

func self(mode string, env ...string) execagent.Config {
	return execagent.Config{Command: []string{os.Args[0]}, Env: append([]string{agentModeEnv + "=" + mode}, env...)}
}

func timeout(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// onlySource returns the rollout's single sample source.
func onlySource(t *testing.T, r *osmo.Rollout) osmotest.Source {
	t.Helper()
	srcs := osmotest.Sources(r)
	if len(srcs) != 1 {
		t.Fatalf("rollout has %d sample sources, want 1", len(srcs))
	}
	return srcs[0]
}

// readPID waits for a pid written to path.
func readPID(t *testing.T, ctx context.Context, path string) int {
	t.Helper()
	for {
		if b, err := os.ReadFile(path); err == nil && len(bytes.TrimSpace(b)) > 0 {
			pid, err := strconv.Atoi(string(bytes.TrimSpace(b)))
			if err != nil {
				t.Fatalf("pid file %s: %v", path, err)
			}
			return pid
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no pid in %s: %v", path, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// requireGone fails unless pid is dead: gone, or a zombie left for a parent
// that does not reap orphans.
func requireGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := syscall.Kill(pid, 0)
		if errors.Is(err, syscall.ESRCH) || zombie(pid) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d still alive (kill 0: %v)", pid, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func zombie(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// pid (comm) state ...: comm may hold spaces, so look after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && strings.HasPrefix(s[i+1:], " Z")
}
