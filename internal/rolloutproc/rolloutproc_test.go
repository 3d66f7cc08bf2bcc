//go:build unix

package rolloutproc_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/osmo-rl/osmo/internal/logtest"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/rolloutproc"
)

// testLogger logs through t, so a failing test shows what happened.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// fixture is the example workspace's stand-in rollout server.
const fixture = "../../examples/osmosis-workspace/rollouts/multiply"

// gone reports whether pid names no process, not even a zombie.
func gone(pid int) bool { return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) }

func waitDone(t *testing.T, s *rolloutproc.Server, d time.Duration) {
	t.Helper()
	select {
	case <-s.Done():
	case <-time.After(d):
		t.Fatalf("process %d still running after %s", s.PID(), d)
	}
	if !gone(s.PID()) {
		t.Errorf("process %d exited but is still there (a zombie?)", s.PID())
	}
}

func TestMain(m *testing.M) {
	if _, err := exec.LookPath("python3"); err != nil {
		fmt.Println("skipping: python3 is not on PATH")
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func start(t *testing.T, ctx context.Context, spec rolloutproc.Spec) *rolloutproc.Server {
	t.Helper()
	if spec.Logger == nil {
		spec.Logger = testLogger(t)
	}
	s, err := rolloutproc.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	return s
}

func getHealth(t *testing.T, url string) (http.Header, map[string]any) {
	t.Helper()
	resp, err := http.Get(url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("/health: %v: %s", err, b)
	}
	return resp.Header, m
}

// TestStartsTheFixture: the example's main.py starts, answers /health with
// this instance's id, and stops on SIGTERM, exiting 0, leaving nothing.
func TestStartsTheFixture(t *testing.T) {
	var out logtest.Buffer
	s := start(t, t.Context(), rolloutproc.Spec{Dir: fixture, Output: &out, Env: map[string]string{"MULTIPLY_SECRET": "x"}, ReadyTimeout: 20 * time.Second})
	if !strings.HasPrefix(s.URL(), "http://127.0.0.1:") {
		t.Errorf("URL = %q", s.URL())
	}
	h, body := getHealth(t, s.URL())
	if h.Get(rolloutproc.InstanceHeader) != s.InstanceID() || body["status"] != "ok" || body["pid"] != float64(s.PID()) {
		t.Errorf("health %v %v; instance %s pid %d", h, body, s.InstanceID(), s.PID())
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitDone(t, s, 10*time.Second)
	if err := s.Err(); err != nil {
		t.Errorf("Err after a clean SIGTERM exit = %v", err)
	}
	if !strings.Contains(out.String(), "listening on "+s.URL()) {
		t.Errorf("output lacks the start line:\n%s", out.String())
	}
}

// TestEnvironmentAndRedaction: the child gets the parent's environment
// minus VIRTUAL_ENV, then Env, then the supervisor's variables; runs in
// the rollout directory; and a secret it prints reaches the output as
// [REDACTED], line by line.
func TestEnvironmentAndRedaction(t *testing.T) {
	t.Setenv("VIRTUAL_ENV", "/some/venv")
	t.Setenv("ROLLOUTPROC_TEST", "from-parent")
	t.Setenv("ROLLOUTPROC_WITHHELD", "parent-only")
	var out logtest.Buffer
	root := t.TempDir()
	s := start(t, t.Context(), rolloutproc.Spec{
		Dir: "testdata", Entrypoint: "envdump.py", Output: &out, ArtifactRoot: root,
		Env:      map[string]string{"ROLLOUTPROC_TEST": "from-env", "ROLLOUTPROC_SECRET": "hunter2-secret"},
		Secrets:  []string{"hunter2-secret", ""},
		Withhold: []string{"ROLLOUTPROC_WITHHELD"},
	})
	_, got := getHealth(t, s.URL())
	abs, _ := filepath.Abs("testdata")
	want := map[string]any{
		"VIRTUAL_ENV": nil, "ROLLOUTPROC_WITHHELD": nil, "ROLLOUTPROC_TEST": "from-env", "ROLLOUTPROC_SECRET": "hunter2-secret",
		"PYTHONUNBUFFERED": "1", "_OSMOSIS_ROLLOUT_PORT": strings.TrimPrefix(s.URL(), "http://127.0.0.1:"),
		"_OSMOSIS_ROLLOUT_ARTIFACT_ROOT": root, "_OSMOSIS_ROLLOUT_INSTANCE_ID": s.InstanceID(),
		"cwd": abs, "artifact_root_exists": true,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	_ = s.Stop(context.Background())
	waitDone(t, s, 10*time.Second)
	o := out.String()
	if strings.Contains(o, "hunter2") || !strings.Contains(o, "the secret is [REDACTED]\n") {
		t.Errorf("output not redacted:\n%s", o)
	}
	if !strings.Contains(o, "partial line without newline\nready\n") {
		t.Errorf("output not passed on line by line:\n%s", o)
	}
}

// TestDefaultArtifactRootIsRemoved: without ArtifactRoot a temporary one
// is made, and removed once the process exited.
func TestDefaultArtifactRootIsRemoved(t *testing.T) {
	s := start(t, t.Context(), rolloutproc.Spec{Dir: "testdata", Entrypoint: "envdump.py"})
	_, got := getHealth(t, s.URL())
	root, _ := got["_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"].(string)
	if root == "" || got["artifact_root_exists"] != true {
		t.Fatalf("artifact root %q (exists %v)", root, got["artifact_root_exists"])
	}
	_ = s.Stop(context.Background())
	waitDone(t, s, 10*time.Second)
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temporary artifact root %s left behind: %v", root, err)
	}
}

// TestExitsAtOnce: a server that exits before answering is a StartError
// carrying its (redacted) output, returned without waiting for the ready
// timeout.
func TestExitsAtOnce(t *testing.T) {
	begin := time.Now()
	_, err := rolloutproc.Start(t.Context(), rolloutproc.Spec{
		Dir: "testdata", Entrypoint: "exits.py", Logger: testLogger(t),
		Env: map[string]string{"ROLLOUTPROC_SECRET": "s3cr3t"}, Secrets: []string{"s3cr3t"},
	})
	var se *rolloutproc.StartError
	if !errors.As(err, &se) {
		t.Fatalf("err = %v, want a StartError", err)
	}
	var ee *rolloutproc.ExitError
	if !errors.As(err, &ee) || ee.Code != 3 || ee.Stopped {
		t.Errorf("err = %#v, want exit status 3", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "exited before answering /health") || !strings.Contains(msg, "boom: [REDACTED]") || strings.Contains(msg, "s3cr3t") {
		t.Errorf("error = %s", msg)
	}
	if took := time.Since(begin); took > 10*time.Second {
		t.Errorf("took %s to notice the exit", took)
	}
}

// TestNeverHealthy: a server that never answers is killed after the ready
// timeout, SIGKILL after the grace period when it ignores SIGTERM, with
// everything in its process group.
func TestNeverHealthy(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "child.pid")
	begin := time.Now()
	_, err := rolloutproc.Start(t.Context(), rolloutproc.Spec{
		Dir: "testdata", Entrypoint: "stubborn.py", Logger: testLogger(t),
		Env:          map[string]string{"ROLLOUTPROC_CHILD_PID_FILE": pidFile},
		ReadyTimeout: 1500 * time.Millisecond, StopGrace: 300 * time.Millisecond,
	})
	if err == nil || !strings.Contains(err.Error(), "did not answer 200 within 1.5s") || !strings.Contains(err.Error(), "never healthy") {
		t.Fatalf("err = %v", err)
	}
	if took := time.Since(begin); took > 8*time.Second {
		t.Errorf("took %s", took)
	}
	b, rerr := os.ReadFile(pidFile)
	if rerr != nil {
		t.Fatal(rerr)
	}
	child, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	deadline := time.Now().Add(5 * time.Second)
	for !gone(child) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if !gone(child) {
		t.Errorf("the server's child %d outlived it", child)
	}
}

// TestContextEndStopsIt: ending Start's context stops a running server.
func TestContextEndStopsIt(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	s := start(t, ctx, rolloutproc.Spec{Dir: "testdata", Entrypoint: "envdump.py", StopGrace: time.Second})
	cancel()
	waitDone(t, s, 10*time.Second)
	var ee *rolloutproc.ExitError
	if !errors.As(s.Err(), &ee) || !ee.Stopped || ee.Signal != "SIGTERM" {
		t.Errorf("Err = %#v, want stopped by SIGTERM", s.Err())
	}
}

// TestKilledFromOutside: a server SIGKILLed by someone else is noticed
// (Done), reaped, and its Err names the signal.
func TestKilledFromOutside(t *testing.T) {
	s := start(t, t.Context(), rolloutproc.Spec{Dir: "testdata", Entrypoint: "envdump.py"})
	if err := syscall.Kill(s.PID(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitDone(t, s, 10*time.Second)
	var ee *rolloutproc.ExitError
	if !errors.As(s.Err(), &ee) || ee.Stopped || ee.Signal != "SIGKILL" || ee.Code != -1 {
		t.Errorf("Err = %#v", s.Err())
	}
	// Stop after the fact returns at once.
	if err := s.Stop(context.Background()); err != nil {
		t.Error(err)
	}
}

// TestAnotherInstanceAnswers: a /health that names another instance is
// refused: someone else holds the port.
func TestAnotherInstanceAnswers(t *testing.T) {
	_, err := rolloutproc.Start(t.Context(), rolloutproc.Spec{
		Dir: "testdata", Entrypoint: "envdump.py", Logger: testLogger(t),
		Env: map[string]string{"ROLLOUTPROC_WRONG_INSTANCE": "1"}, StopGrace: time.Second,
	})
	if err == nil || !strings.Contains(err.Error(), `names instance "someone-else"`) {
		t.Fatalf("err = %v", err)
	}
}

// TestBadSpec: a missing directory or entrypoint, and an Env that sets the
// supervisor's variables, are refused before anything starts.
func TestBadSpec(t *testing.T) {
	for name, spec := range map[string]rolloutproc.Spec{
		"no dir":        {Dir: "testdata/nope"},
		"no entrypoint": {Dir: "testdata", Entrypoint: "nope.py"},
		"reserved env":  {Dir: fixture, Env: map[string]string{"_OSMOSIS_ROLLOUT_PORT": "1"}},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := rolloutproc.Start(t.Context(), spec); err == nil {
				t.Fatal("started")
			}
		})
	}
}

// fakeUV puts a uv on PATH that logs its arguments to $dir/uv.log, fails
// "sync" when $FAKE_UV_FAIL is set, and runs "run ... ENTRYPOINT" with
// python3.
func fakeUV(t *testing.T) (logFile string) {
	dir := t.TempDir()
	logFile = filepath.Join(dir, "uv.log")
	script := `#!/bin/sh
echo "$@" >> ` + logFile + `
if [ "$1" = sync ]; then
  if [ -n "$FAKE_UV_FAIL" ]; then echo "resolution failed" >&2; exit 2; fi
  exit 0
fi
for last; do :; done
exec python3 "$last"
`
	if err := os.WriteFile(filepath.Join(dir, "uv"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	return logFile
}

// TestUsesUVWhenOnPath: with uv on PATH the rollout's project is synced,
// then its entrypoint run with uv run --no-sync, as the SDK does.
func TestUsesUVWhenOnPath(t *testing.T) {
	logFile := fakeUV(t)
	s := start(t, t.Context(), rolloutproc.Spec{Dir: "testdata", Entrypoint: "envdump.py"})
	getHealth(t, s.URL())
	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	abs, _ := filepath.Abs("testdata")
	if want := "sync --project " + abs + "\nrun --no-sync --project " + abs + " envdump.py\n"; string(b) != want {
		t.Errorf("uv was run with\n%s\nwant\n%s", b, want)
	}
}

// TestUVSyncFailure: a failed uv sync fails the start with its output.
func TestUVSyncFailure(t *testing.T) {
	fakeUV(t)
	t.Setenv("FAKE_UV_FAIL", "1")
	_, err := rolloutproc.Start(t.Context(), rolloutproc.Spec{Dir: "testdata", Entrypoint: "envdump.py", Logger: testLogger(t)})
	if err == nil || !strings.Contains(err.Error(), "uv sync failed") || !strings.Contains(err.Error(), "resolution failed") {
		t.Fatalf("err = %v", err)
	}
}
