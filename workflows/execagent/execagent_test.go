//go:build unix

package execagent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/cgroup"
	"github.com/osmo-rl/osmo/osmotest"
	"github.com/osmo-rl/osmo/workflows/execagent"
)

// promptly bounds how long a run that must not hang may take.
const promptly = 5 * time.Second

func TestEnvironmentAndStdin(t *testing.T) {
	// What the server has that must not reach the program.
	t.Setenv("OPENAI_ORG_ID", "org-leak")
	t.Setenv("OPENAI_BASE_URL", "https://api.openai.example/v1")
	t.Setenv("OPENAI_API_KEY", "sk-leak")
	t.Setenv("openai_api_key", "sk-leak-lower")
	t.Setenv("OSMO_API_KEY", "osmo-leak")
	t.Setenv("OSMOSIS_ROLLOUT_SERVER_MAX_CONCURRENT_ROLLOUTS", "7")
	t.Setenv("EXECAGENT_PARENT_VAR", "kept")
	t.Setenv("EXECAGENT_SERVER_SECRET", "not-allowlisted")
	t.Setenv("LC_ALL", "C.UTF-8")

	for _, tc := range []struct {
		name      string
		prompt    []osmo.Message
		metadata  map[string]any
		settings  string
		wantStdin string
	}{
		{
			name:      "everything given",
			prompt:    []osmo.Message{{"role": "user", "content": "6 × 7 <b>?"}},
			metadata:  map[string]any{"row": 1, "tag": "a&b"},
			settings:  ` { "temperature": 0.5, "nested": {"k": [1, 2]} } `,
			wantStdin: `{"prompt":[{"content":"6 × 7 <b>?","role":"user"}],"metadata":{"row":1,"tag":"a&b"},"config":{"temperature":0.5,"nested":{"k":[1,2]}}}` + "\n",
		},
		{
			name:      "nothing given",
			wantStdin: `{"prompt":[],"metadata":{},"config":{}}` + "\n",
		},
		{
			name:      "null settings",
			prompt:    []osmo.Message{{"role": "user", "content": "q"}},
			settings:  "null",
			wantStdin: `{"prompt":[{"content":"q","role":"user"}],"metadata":{},"config":{}}` + "\n",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := self("dump", "EXTRA_VAR=a=b", "EXECAGENT_PARENT_VAR=overridden")
			cfg.Settings = json.RawMessage(tc.settings)
			_, r, err := run(t, timeout(t, 20*time.Second), cfg,
				&osmotest.Input{RolloutID: "rollout-1", Prompt: tc.prompt, Metadata: tc.metadata})
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			src := onlySource(t, r)
			if src.ID != execagent.DefaultName {
				t.Errorf("sample id %q, want %q", src.ID, execagent.DefaultName)
			}
			msgs, err := osmotest.Messages(src.Source)
			if err != nil || !reflect.DeepEqual(msgs, []osmo.Message{{"role": "assistant", "content": "dumped"}}) {
				t.Fatalf("SampleMessages = %v, %v", msgs, err)
			}
			extras := src.Source.(osmo.SampleExtras).SampleExtraFields()
			if got := extras["stdin"]; got != tc.wantStdin {
				t.Errorf("stdin:\n got %q\nwant %q", got, tc.wantStdin)
			}

			got := map[string]string{}
			for _, kv := range extras["env"].([]any) {
				k, v, _ := strings.Cut(kv.(string), "=")
				got[k] = v
			}
			// The allowlist's variables of the server's, and no others.
			want := map[string]string{}
			for _, kv := range os.Environ() {
				if k, v, _ := strings.Cut(kv, "="); execagent.AllowedEnv(k) {
					want[k] = v
				}
			}
			if want["LC_ALL"] != "C.UTF-8" {
				t.Errorf("LC_* is not allowed: %v", want)
			}
			for _, k := range []string{"TMPDIR", "TMP", "TEMP"} {
				if !strings.Contains(got[k], "osmo-exec-") {
					t.Errorf("%s=%q, want the run's scratch directory", k, got[k])
				}
				want[k] = got[k]
			}
			base := "http://127.0.0.1:1/r/rollout-1/s/exec/v1"
			for k, v := range map[string]string{
				agentModeEnv:                    "dump",
				"EXTRA_VAR":                     "a=b",
				"EXECAGENT_PARENT_VAR":          "overridden",
				"OPENAI_BASE_URL":               base,
				"OSMOSIS_CHAT_COMPLETIONS_URL":  base,
				"OPENAI_API_KEY":                "tok-rollout-1",
				"OSMOSIS_ROLLOUT_ID":            "rollout-1",
				"OSMOSIS_SAMPLE_ID":             "exec",
				"OPENAI_DEFAULT_MODEL":          "openai/osmosis-rollout",
				"OPENAI_AGENTS_DISABLE_TRACING": "1",
			} {
				want[k] = v
			}
			if !reflect.DeepEqual(got, want) {
				for k, v := range got {
					if w, ok := want[k]; !ok || w != v {
						t.Errorf("env %s=%q, want %q (present: %v)", k, v, w, ok)
					}
				}
				for k := range want {
					if _, ok := got[k]; !ok {
						t.Errorf("env lacks %s", k)
					}
				}
			}
			if cwd := extras["cwd"]; cwd != got["TMPDIR"] {
				t.Errorf("working directory %v, want the scratch directory %s", cwd, got["TMPDIR"])
			}
			if _, err := os.Stat(got["TMPDIR"]); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("scratch directory %s outlived the run: %v", got["TMPDIR"], err)
			}
			for _, k := range []string{"OPENAI_ORG_ID", "OSMO_API_KEY", "openai_api_key", "OSMOSIS_ROLLOUT_SERVER_MAX_CONCURRENT_ROLLOUTS", "EXECAGENT_SERVER_SECRET"} {
				if v, ok := got[k]; ok {
					t.Errorf("%s=%q leaked into the program's environment", k, v)
				}
			}
		})
	}
}

func TestLastStdoutLine(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		script     string
		maxLine    int
		want       []osmo.Message
		wantExtras map[string]any
		wantErr    string
	}{
		{
			name: "messages of the last line",
			script: `echo starting; echo '{"messages":[{"role":"user","content":"stale"}]}'
echo '{"messages":[{"role":"assistant","content":"a","tool_calls":[]},{"type":"function_call","callId":"c1"}],"extra_fields":{"k":1}}'
printf '\n   \n'`,
			want:       []osmo.Message{{"role": "assistant", "content": "a", "tool_calls": []any{}}, {"type": "function_call", "callId": "c1"}},
			wantExtras: map[string]any{"k": 1.0},
		},
		{name: "no final newline", script: `printf '{"messages":[{"role":"assistant","content":"x"}]}'`, want: []osmo.Message{{"role": "assistant", "content": "x"}}},
		{name: "CRLF and empty messages", script: `printf '{"messages":[]}\r\n'`, want: []osmo.Message{}},
		{name: "garbage after messages", script: `echo '{"messages":[{"role":"user"}]}'; echo 'done!'`},
		{name: "no output", script: `true`},
		{name: "null last line", script: `echo null`},
		{name: "array last line", script: `echo '[{"messages":[]}]'`},
		{name: "object without messages", script: `echo '{"status":"ok","extra_fields":{"a":"b"}}'`, wantExtras: map[string]any{"a": "b"}},
		{name: "messages an object", script: `echo '{"messages":{"role":"user"}}'`, wantErr: `last stdout line: "messages" must be an array of objects`},
		{name: "messages null", script: `echo '{"messages":null}'`, wantErr: `"messages" must be an array of objects`},
		{name: "message not an object", script: `echo '{"messages":[{"role":"user"},"hi"]}'`, wantErr: `messages[1] is "hi"`},
		{name: "extra_fields not an object", script: `echo '{"messages":[],"extra_fields":[1]}'`, wantErr: `"extra_fields" must be an object`},
		{
			name:    "last line too long",
			script:  `echo '{"messages":[]}'; head -c 200 /dev/zero | tr '\0' x; echo`,
			maxLine: 64,
			wantErr: "longer than max_line_bytes (64)",
		},
		{
			name:    "long line skipped before the last",
			script:  `head -c 200 /dev/zero | tr '\0' x; echo; echo '{"messages":[{"n":1}]}'`,
			maxLine: 64,
			want:    []osmo.Message{{"n": 1.0}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := shell(tc.script)
			cfg.MaxLineBytes = tc.maxLine
			_, r, err := run(t, timeout(t, 20*time.Second), cfg, nil)
			src := onlySource(t, r)
			msgs, msgErr := osmotest.Messages(src.Source)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), `sample "exec"`) {
					t.Errorf("Run error %v, want one naming sample \"exec\" and %q", err, tc.wantErr)
				}
				if msgErr == nil || !strings.Contains(msgErr.Error(), tc.wantErr) {
					t.Errorf("SampleMessages error %v, want %q", msgErr, tc.wantErr)
				}
				return
			}
			if err != nil || msgErr != nil {
				t.Fatalf("Run: %v; SampleMessages: %v", err, msgErr)
			}
			if !reflect.DeepEqual(msgs, tc.want) || (msgs == nil) != (tc.want == nil) {
				t.Errorf("messages %#v, want %#v", msgs, tc.want)
			}
			if got := src.Source.(osmo.SampleExtras).SampleExtraFields(); !reflect.DeepEqual(got, tc.wantExtras) {
				t.Errorf("extra fields %v, want %v", got, tc.wantExtras)
			}
		})
	}
}

func TestFailedProgram(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		script    string
		tailBytes int
		want      execagent.ExitError
		// wantTailHas must be in the tail (when want.StderrTail is empty).
		wantTailHas string
	}{
		{name: "exit status", script: `echo 'first line' >&2; echo 'second line' >&2; exit 3`, want: execagent.ExitError{Code: 3}, wantTailHas: "first line\nsecond line\n"},
		{name: "tail bounded", script: `printf 'abcdefghijklmnop' >&2; exit 1`, tailBytes: 8, want: execagent.ExitError{Code: 1, StderrTail: "ijklmnop"}},
		{name: "killed by a signal", script: `echo dying >&2; kill -KILL $$`, want: execagent.ExitError{Code: -1, Signal: "SIGKILL"}, wantTailHas: "dying"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := shell(tc.script)
			cfg.StderrTailBytes = tc.tailBytes
			rt, r, err := run(t, timeout(t, 20*time.Second), cfg, nil)
			var exitErr *execagent.ExitError
			if !errors.As(err, &exitErr) {
				t.Fatalf("Run error %v (%T), want an *ExitError", err, err)
			}
			if exitErr.Code != tc.want.Code || exitErr.Signal != tc.want.Signal {
				t.Errorf("exit code %d signal %q, want %d %q", exitErr.Code, exitErr.Signal, tc.want.Code, tc.want.Signal)
			}
			if tc.want.StderrTail != "" && exitErr.StderrTail != tc.want.StderrTail {
				t.Errorf("stderr tail %q, want %q", exitErr.StderrTail, tc.want.StderrTail)
			}
			if !strings.Contains(exitErr.StderrTail, tc.wantTailHas) {
				t.Errorf("stderr tail %q lacks %q", exitErr.StderrTail, tc.wantTailHas)
			}
			if msg := err.Error(); !strings.Contains(msg, `sample "exec"`) || !strings.Contains(msg, strings.TrimSpace(exitErr.StderrTail)) {
				t.Errorf("error %q does not name the sample and carry the tail", msg)
			}
			if _, err := osmotest.Messages(onlySource(t, r).Source); !errors.As(err, &exitErr) {
				t.Errorf("SampleMessages error %v, want the run's *ExitError", err)
			}
			if tc.name == "exit status" {
				events := rt.Events()
				want := []event{
					{"agent_stderr", map[string]any{"sample_id": "exec", "line": "first line"}},
					{"agent_stderr", map[string]any{"sample_id": "exec", "line": "second line"}},
				}
				if !reflect.DeepEqual(events, want) {
					t.Errorf("events %v, want %v", events, want)
				}
				if logs := rt.Logs(); !strings.Contains(logs, `"sample_id":"exec","stream":"stderr","line":"second line"`) {
					t.Errorf("logs lack the stderr line with sample_id and stream:\n%s", logs)
				}
			}
		})
	}
}

func TestLongStderrLineIsCut(t *testing.T) {
	t.Parallel()
	rt, _, err := run(t, timeout(t, 20*time.Second), shell(`head -c 10000 /dev/zero | tr '\0' e >&2; echo >&2; echo short >&2`), nil)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	events := rt.Events()
	if len(events) != 2 {
		t.Fatalf("%d events, want 2", len(events))
	}
	if line := events[0].data["line"].(string); len(line) != 4096 || strings.Trim(line, "e") != "" {
		t.Errorf("long line logged as %d bytes, want the first 4096", len(line))
	}
	if events[1].data["line"] != "short" {
		t.Errorf("second line %v, want short", events[1].data["line"])
	}
	if logs := rt.Logs(); !strings.Contains(logs, `"truncated_bytes":5904`) {
		t.Errorf("logs do not say how much was cut:\n%.500s", logs)
	}
}

// TestStdoutFlood is not parallel: it measures the heap the run allocates.
func TestStdoutFlood(t *testing.T) {
	const flood = 50 << 20
	final := `echo '{"messages":[{"role":"assistant","content":"after the flood"}]}'`
	for _, tc := range []struct{ name, script string }{
		{"one endless line", `head -c 52428800 /dev/zero; echo; ` + final},
		{"many lines", `yes flood | head -c 52428800; echo; ` + final},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := shell(tc.script)
			cfg.MaxLineBytes = 4096
			wf, err := execagent.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			_, r := newRollout("rollout-1")
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			err = osmotest.Run(timeout(t, 25*time.Second), wf, r, &osmotest.Input{RolloutID: r.ID})
			runtime.ReadMemStats(&after)
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > flood/8 {
				t.Errorf("the run allocated %d bytes for %d bytes of output, want it bounded by max_line_bytes", alloc, flood)
			}
			msgs, err := osmotest.Messages(onlySource(t, r).Source)
			if err != nil || osmo.LastAssistantText(msgs) != "after the flood" {
				t.Errorf("SampleMessages = %v, %v; want the final line's message", msgs, err)
			}
		})
	}
}

func TestContextEndKillsTheGroup(t *testing.T) {
	t.Parallel()
	const sleeper = `echo $$ > "$LEADERFILE"; sleep 1000 & echo $! > "$PIDFILE"; wait`
	for _, tc := range []struct {
		name    string
		script  string
		grace   time.Duration
		cancel  bool
		wantErr error
		wantMsg string
	}{
		{name: "deadline", script: sleeper, wantErr: context.DeadlineExceeded, wantMsg: "process group killed (SIGTERM)"},
		{name: "deadline with SIGTERM ignored", script: `trap '' TERM; ` + sleeper, grace: 300 * time.Millisecond,
			wantErr: context.DeadlineExceeded, wantMsg: "process group killed (SIGTERM, then SIGKILL after 300ms)"},
		{name: "cancel", script: sleeper, cancel: true, wantErr: context.Canceled, wantMsg: "process group killed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			pidFile, leaderFile := filepath.Join(dir, "pid"), filepath.Join(dir, "leader")
			cfg := shell(tc.script, "PIDFILE="+pidFile, "LEADERFILE="+leaderFile)
			cfg.KillGrace = tc.grace

			ctx, cancel := context.WithTimeout(t.Context(), 1500*time.Millisecond)
			defer cancel()
			if tc.cancel {
				ctx, cancel = context.WithCancel(t.Context())
				defer cancel()
				go func() {
					readPID(t, timeout(t, 10*time.Second), pidFile)
					cancel()
				}()
			}
			start := time.Now()
			_, r, err := run(t, ctx, cfg, nil)
			elapsed := time.Since(start)

			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Run error %v, want %v", err, tc.wantErr)
			}
			if msg := err.Error(); !strings.Contains(msg, tc.wantMsg) || !strings.Contains(msg, `sample "exec"`) {
				t.Errorf("error %q, want it to name the sample and say %q", msg, tc.wantMsg)
			}
			if elapsed > promptly {
				t.Errorf("Run took %v after the context ended", elapsed)
			}
			if _, err := osmotest.Messages(onlySource(t, r).Source); !errors.Is(err, tc.wantErr) {
				t.Errorf("SampleMessages error %v, want %v", err, tc.wantErr)
			}
			requireGone(t, readPID(t, t.Context(), leaderFile))
			requireGone(t, readPID(t, t.Context(), pidFile))
		})
	}
}

func TestNormalExitKillsLeftovers(t *testing.T) {
	t.Parallel()
	pidFile := filepath.Join(t.TempDir(), "pid")
	// The grandchild holds stdout open: without the group kill the run
	// would wait out the grace period.
	cfg := shell(`sleep 1000 & echo $! > "$PIDFILE"; echo '{"messages":[{"role":"assistant","content":"ok"}]}'`, "PIDFILE="+pidFile)
	cfg.KillGrace = 20 * time.Second
	start := time.Now()
	_, r, err := run(t, timeout(t, 25*time.Second), cfg, nil)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if elapsed := time.Since(start); elapsed > promptly {
		t.Errorf("Run took %v: the leftover grandchild kept it waiting", elapsed)
	}
	requireGone(t, readPID(t, t.Context(), pidFile))
	if msgs, err := osmotest.Messages(onlySource(t, r).Source); err != nil || osmo.LastAssistantText(msgs) != "ok" {
		t.Errorf("SampleMessages = %v, %v", msgs, err)
	}
}

func TestEscapedProcessCannotHoldTheRun(t *testing.T) {
	t.Parallel()
	pidFile := filepath.Join(t.TempDir(), "pid")
	cfg := self("escape", "PIDFILE="+pidFile)
	cfg.KillGrace = 300 * time.Millisecond
	start := time.Now()
	rt, r, err := run(t, timeout(t, 20*time.Second), cfg, nil)
	if pid := readPID(t, t.Context(), pidFile); pid > 0 {
		t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	}
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if elapsed := time.Since(start); elapsed > promptly {
		t.Errorf("Run took %v with an escaped process holding stdout", elapsed)
	}
	if msgs, err := osmotest.Messages(onlySource(t, r).Source); err != nil || osmo.LastAssistantText(msgs) != "escaped" {
		t.Errorf("SampleMessages = %v, %v", msgs, err)
	}
	// Where the run has a cgroup, the escaped process dies with the run;
	// elsewhere the runner stops reading the output it holds, and says so.
	if !strings.Contains(rt.Logs(), "a process outside the group holds it") {
		if pid := readPID(t, t.Context(), pidFile); pid > 0 {
			requireGone(t, pid)
		}
	}
}

// TestFirstForkIsContained starts programs that fork as their first act:
// each child must be in the run's cgroup, never in the server's, or a fork
// bomb would escape the process limit.
func TestFirstForkIsContained(t *testing.T) {
	t.Parallel()
	if _, err := cgroup.Detect(); err != nil {
		t.Skipf("runs get no cgroup here: %v", err)
	}
	cfg := shell(`sleep 5 & p=$!
if grep -q osmo-exec- /proc/$p/cgroup; then w=inside; else w=outside; fi
printf '{"messages":[{"role":"assistant","content":"%s"}]}\n' $w`)
	for i := range 20 {
		_, r, err := run(t, timeout(t, 20*time.Second), cfg, nil)
		if err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
		if msgs, _ := osmotest.Messages(onlySource(t, r).Source); osmo.LastAssistantText(msgs) != "inside" {
			t.Fatalf("run %d: the program's first child started outside the run's cgroup (%v)", i, msgs)
		}
	}
}

func TestSamples(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// Each run waits until all three started: they must run concurrently.
	cfg := shell(`touch "$DIR/$OSMOSIS_SAMPLE_ID"
i=0; while [ "$(ls "$DIR" | wc -l)" -lt 3 ]; do sleep 0.02; i=$((i+1)); [ $i -gt 500 ] && exit 9; done
printf '{"messages":[{"role":"assistant","content":"%s %s"}]}\n' "$OSMOSIS_SAMPLE_ID" "$OPENAI_BASE_URL"`, "DIR="+dir)
	cfg.Name = "solver"
	cfg.Samples = 3
	_, r, err := run(t, timeout(t, 20*time.Second), cfg, nil)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	srcs := osmotest.Sources(r)
	if len(srcs) != 3 {
		t.Fatalf("%d sources, want 3", len(srcs))
	}
	for i, src := range srcs {
		id := "solver-" + string(rune('0'+i))
		if src.ID != id {
			t.Errorf("source %d is %q, want %q", i, src.ID, id)
		}
		msgs, err := osmotest.Messages(src.Source)
		want := id + " http://127.0.0.1:1/r/rollout-1/s/" + id + "/v1"
		if err != nil || osmo.LastAssistantText(msgs) != want {
			t.Errorf("%s: SampleMessages = %v, %v; want %q", id, msgs, err, want)
		}
	}
}

func TestSampleFailureStopsTheOthers(t *testing.T) {
	t.Parallel()
	cfg := shell(`if [ "$OSMOSIS_SAMPLE_ID" = exec-0 ]; then echo boom >&2; exit 4; fi; exec sleep 1000`)
	cfg.Samples = 2
	start := time.Now()
	_, r, err := run(t, timeout(t, 20*time.Second), cfg, nil)
	var exitErr *execagent.ExitError
	if !errors.As(err, &exitErr) || exitErr.Code != 4 || !strings.Contains(err.Error(), `sample "exec-0"`) {
		t.Fatalf("Run error %v, want exec-0's exit status 4", err)
	}
	if elapsed := time.Since(start); elapsed > promptly {
		t.Errorf("Run took %v: the sleeping sample was not stopped", elapsed)
	}
	if _, err := osmotest.Messages(osmotest.Sources(r)[1].Source); !errors.Is(err, context.Canceled) {
		t.Errorf("exec-1: SampleMessages error %v, want context.Canceled", err)
	}
}

func TestDuplicateSampleID(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		samples int
		taken   string
	}{
		{"one sample", 0, "exec"},
		{"last of two", 2, "exec-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			marker := filepath.Join(t.TempDir(), "ran")
			cfg := shell(`touch "$MARKER"`, "MARKER="+marker)
			cfg.Samples = tc.samples
			wf, err := execagent.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			_, r := newRollout("rollout-1")
			if err := r.Register(tc.taken, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return nil, nil })); err != nil {
				t.Fatal(err)
			}
			err = osmotest.Run(timeout(t, 10*time.Second), wf, r, &osmotest.Input{RolloutID: r.ID})
			if !errors.Is(err, osmo.ErrDuplicateSample) || !strings.Contains(err.Error(), `sample "`+tc.taken+`"`) {
				t.Fatalf("Run error %v, want ErrDuplicateSample naming %q", err, tc.taken)
			}
			if _, err := os.Stat(marker); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the program ran despite the clash (marker: %v)", err)
			}
		})
	}
}

func TestCommandResolution(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// The agent prints where it runs, its own path, its arguments and the
	// first line of the file its first argument names.
	script := filepath.Join(dir, "agent.sh")
	body := `#!/bin/sh
line=$(head -n 1 "$1")
printf '{"messages":[{"role":"assistant","content":"%s %s %s %s"}]}\n' "$(basename "$PWD")" "$0" "$*" "$line"
`
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "data.txt"), []byte("from dir\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "pkg"), 0o755); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name    string
		command []string
		want    string
	}{
		{
			name:    "relative program",
			command: []string{"./agent.sh", "data.txt", "./pkg", ".", "pkg", "-x", "absent.txt"},
			want:    script + " " + dir + "/data.txt " + dir + "/pkg " + dir + " pkg -x absent.txt from dir",
		},
		{
			// sh finds agent.sh on its own only in its working directory,
			// which is the scratch directory.
			name:    "program on PATH, script argument",
			command: []string{"sh", "agent.sh", "data.txt"},
			want:    dir + "/agent.sh " + dir + "/data.txt from dir",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, r, err := run(t, timeout(t, 10*time.Second), execagent.Config{Command: tc.command, Dir: dir}, nil)
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			msgs, _ := osmotest.Messages(onlySource(t, r).Source)
			cwd, rest, _ := strings.Cut(osmo.LastAssistantText(msgs), " ")
			if !strings.HasPrefix(cwd, "osmo-exec-") {
				t.Errorf("the program ran in %q, want its scratch directory", cwd)
			}
			if rest != tc.want {
				t.Errorf("the program saw\n %q\nwant\n %q", rest, tc.want)
			}
		})
	}

	t.Run("removed after New", func(t *testing.T) {
		gone := filepath.Join(t.TempDir(), "gone.sh")
		if err := os.WriteFile(gone, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		wf, err := execagent.New(execagent.Config{Command: []string{gone}})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(gone); err != nil {
			t.Fatal(err)
		}
		_, r := newRollout("rollout-1")
		err = osmotest.Run(timeout(t, 10*time.Second), wf, r, &osmotest.Input{RolloutID: r.ID})
		var cfgErr *execagent.ConfigError
		if !errors.As(err, &cfgErr) || cfgErr.Field != "command[0]" || !strings.Contains(err.Error(), gone) {
			t.Fatalf("Run error %v, want a command[0] error naming %s", err, gone)
		}
	})
}

// TestScratchWorkingDirectory runs two rollouts of an agent that writes
// into its working directory at once: each writes into a directory of its
// own under scratch_dir, and neither directory outlives its run.
func TestScratchWorkingDirectory(t *testing.T) {
	t.Parallel()
	base, seen, dir := t.TempDir(), t.TempDir(), t.TempDir()
	// Each run records its working directory, then waits for the other's:
	// they must be running at once.
	cfg := shell(`pwd > "$SEEN/$OSMOSIS_ROLLOUT_ID"; echo "$OSMOSIS_ROLLOUT_ID" > work.txt
i=0; while [ "$(ls "$SEEN" | wc -l)" -lt 2 ]; do sleep 0.02; i=$((i+1)); [ $i -gt 500 ] && exit 9; done
printf '{"messages":[{"role":"assistant","content":"%s"}]}\n' "$(cat work.txt)"`, "SEEN="+seen)
	cfg.Dir, cfg.ScratchDir = dir, base
	wf, err := execagent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{"rollout-a", "rollout-b"}
	errs := make([]error, len(ids))
	rollouts := make([]*osmo.Rollout, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		_, r := newRollout(id)
		rollouts[i] = r
		wg.Go(func() { errs[i] = osmotest.Run(timeout(t, 20*time.Second), wf, r, &osmotest.Input{RolloutID: id}) })
	}
	wg.Wait()
	wds := map[string]string{}
	for i, id := range ids {
		if errs[i] != nil {
			t.Fatalf("%s: Run: %v", id, errs[i])
		}
		// Each read back its own file: nothing the other wrote.
		if msgs, err := osmotest.Messages(onlySource(t, rollouts[i]).Source); err != nil || osmo.LastAssistantText(msgs) != id {
			t.Errorf("%s: SampleMessages = %v, %v; want its own work.txt", id, msgs, err)
		}
		b, err := os.ReadFile(filepath.Join(seen, id))
		if err != nil {
			t.Fatal(err)
		}
		wd := strings.TrimSpace(string(b))
		if filepath.Dir(wd) != base || !strings.HasPrefix(filepath.Base(wd), "osmo-exec-") {
			t.Errorf("%s ran in %s, want a directory osmo-exec-* under %s", id, wd, base)
		}
		wds[wd] = id
	}
	if len(wds) != 2 {
		t.Errorf("both rollouts ran in one directory: %v", wds)
	}
	for wd := range wds {
		if _, err := os.Stat(wd); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("scratch directory %s outlived its run: %v", wd, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "work.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a run wrote into dir: %v", err)
	}
}

// TestScratchLeftByAKilledServerIsSwept: the first run under a base
// removes the scratch directories of servers that are gone (killed before
// they removed them), and leaves those of live ones and other files.
func TestScratchLeftByAKilledServerIsSwept(t *testing.T) {
	t.Parallel()
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	base := t.TempDir()
	dead := filepath.Join(base, fmt.Sprintf("osmo-exec-%d-123", gone.Process.Pid))
	live := filepath.Join(base, fmt.Sprintf("osmo-exec-%d-456", os.Getppid()))
	other := filepath.Join(base, "osmo-exec-notapid-789")
	for _, d := range []string{dead, live, other} {
		if err := os.MkdirAll(filepath.Join(d, "work", "deep"), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	// A directory the agent took its own permissions from goes too.
	if err := os.Chmod(filepath.Join(dead, "work"), 0); err != nil {
		t.Fatal(err)
	}
	cfg := shell(`printf '{"messages":[{"role":"assistant","content":"ok"}]}\n'`)
	cfg.ScratchDir = base
	wf, err := execagent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, r := newRollout("after-a-kill")
	if err := osmotest.Run(timeout(t, 20*time.Second), wf, r, &osmotest.Input{RolloutID: "after-a-kill"}); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := os.Stat(dead); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the gone server's scratch directory stayed: %v", err)
	}
	for _, d := range []string{live, other} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("%s was removed: %v", d, err)
		}
	}
}

// TestScratchRemovedHowTheRunEnds checks the scratch directory goes with a
// run that failed, was killed at its deadline, or locked its files away.
func TestScratchRemovedHowTheRunEnds(t *testing.T) {
	t.Parallel()
	const record = `pwd > "$SEEN/wd"; mkdir -p deep/er && echo x > deep/er/f; `
	for _, tc := range []struct {
		name, script string
		deadline     time.Duration
	}{
		{name: "success", script: record + `echo '{"messages":[]}'`},
		{name: "exit status", script: record + `exit 3`},
		{name: "deadline", script: record + `trap '' TERM; sleep 1000`, deadline: 500 * time.Millisecond},
		{name: "files locked away", script: record + `chmod 0 deep/er deep; echo '{"messages":[]}'`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			base, seen := t.TempDir(), t.TempDir()
			cfg := shell(tc.script, "SEEN="+seen)
			cfg.ScratchDir = base
			cfg.KillGrace = 100 * time.Millisecond
			ctx := timeout(t, 20*time.Second)
			if tc.deadline > 0 {
				ctx = timeout(t, tc.deadline)
			}
			_, _, err := run(t, ctx, cfg, nil)
			if (err == nil) != (tc.name == "success" || tc.name == "files locked away") {
				t.Errorf("Run: %v", err)
			}
			b, rerr := os.ReadFile(filepath.Join(seen, "wd"))
			if rerr != nil || !strings.HasPrefix(string(b), base+"/osmo-exec-") {
				t.Fatalf("the run recorded working directory %q (%v), want one under %s", b, rerr, base)
			}
			if left, err := os.ReadDir(base); err != nil || len(left) != 0 {
				t.Errorf("scratch base holds %v after the run (%v), want nothing", left, err)
			}
		})
	}
}

func TestConfigJSON(t *testing.T) {
	t.Parallel()
	cfg := self("dump")
	cfg.Settings = json.RawMessage(`{"a":1}`)
	wf, err := execagent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(wf.Config())
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil || doc["name"] != "exec" || doc["settings"].(map[string]any)["a"] != 1.0 {
		t.Fatalf("config = %s (%v)", raw, err)
	}

	next, err := wf.WithConfigJSON([]byte(`{"name":"rebound","settings":{"b":[true]}}`))
	if err != nil {
		t.Fatalf("WithConfigJSON: %v", err)
	}
	_, r := newRollout("rollout-1")
	if err := osmotest.Run(timeout(t, 20*time.Second), next, r, &osmotest.Input{RolloutID: r.ID}); err != nil {
		t.Fatalf("Run: %v", err)
	}
	src := onlySource(t, r)
	stdin, _ := src.Source.(osmo.SampleExtras).SampleExtraFields()["stdin"].(string)
	if src.ID != "rebound" || !strings.Contains(stdin, `"config":{"b":[true]}`) {
		t.Errorf("rebound workflow ran sample %q with stdin %q", src.ID, stdin)
	}

	// Rebinding lays the file over a copy of the config: the original
	// keeps its own command, env and settings.
	if _, err := wf.WithConfigJSON([]byte(`{"command":["sh","-c","exit 0"],"env":["X=1"],"settings":{"zz":0}}`)); err != nil {
		t.Fatalf("WithConfigJSON: %v", err)
	}
	if orig := wf.Config().(*execagent.Config); orig.Command[0] != os.Args[0] || orig.Env[0] != agentModeEnv+"=dump" || string(orig.Settings) != `{"a":1}` {
		t.Errorf("the original config changed: command %q env %q settings %s", orig.Command, orig.Env, orig.Settings)
	}

	for body, field := range map[string]string{
		`{"settings":[1]}`:                "settings",
		`{"command":["no-such-cmd-xyz"]}`: "command[0]",
		`{"samples":-2}`:                  "samples",
	} {
		_, err := wf.WithConfigJSON([]byte(body))
		var cfgErr *execagent.ConfigError
		if !errors.As(err, &cfgErr) || cfgErr.Field != field {
			t.Errorf("WithConfigJSON(%s) error %v, want a %s error", body, err, field)
		}
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		cfg   execagent.Config
		field string
		is    error
		msg   string
	}{
		{name: "no command", cfg: execagent.Config{}, field: "command", msg: "is required"},
		{name: "empty program", cfg: execagent.Config{Command: []string{""}}, field: "command[0]"},
		{name: "program not found", cfg: execagent.Config{Command: []string{"no-such-program-xyz"}}, field: "command[0]", is: exec.ErrNotFound, msg: "no-such-program-xyz"},
		{name: "not executable", cfg: execagent.Config{Command: []string{file}}, field: "command[0]", msg: "permission denied"},
		{name: "settings an array", cfg: execagent.Config{Command: []string{"true"}, Settings: json.RawMessage(`[1]`)}, field: "settings", msg: "must be a JSON object"},
		{name: "settings a string", cfg: execagent.Config{Command: []string{"true"}, Settings: json.RawMessage(`"x"`)}, field: "settings"},
		{name: "settings invalid", cfg: execagent.Config{Command: []string{"true"}, Settings: json.RawMessage(`{"a":`)}, field: "settings"},
		{name: "negative samples", cfg: execagent.Config{Command: []string{"true"}, Samples: -1}, field: "samples"},
		{name: "too many samples", cfg: execagent.Config{Command: []string{"true"}, Samples: execagent.MaxSamples + 1}, field: "samples"},
		{name: "env without =", cfg: execagent.Config{Command: []string{"true"}, Env: []string{"A=1", "B"}}, field: "env[1]"},
		{name: "env reserved", cfg: execagent.Config{Command: []string{"true"}, Env: []string{"OPENAI_BASE_URL=http://elsewhere"}}, field: "env[0]", msg: "reserved"},
		{name: "env credential", cfg: execagent.Config{Command: []string{"true"}, Env: []string{"OSMO_API_KEY=x"}}, field: "env[0]"},
		{name: "missing dir", cfg: execagent.Config{Command: []string{"true"}, Dir: filepath.Join(file, "nope")}, field: "dir"},
		{name: "dir a file", cfg: execagent.Config{Command: []string{"true"}, Dir: file}, field: "dir", msg: "not a directory"},
		{name: "missing scratch_dir", cfg: execagent.Config{Command: []string{"true"}, ScratchDir: filepath.Join(file, "nope")}, field: "scratch_dir"},
		{name: "scratch_dir a file", cfg: execagent.Config{Command: []string{"true"}, ScratchDir: file}, field: "scratch_dir", msg: "not a directory"},
		{name: "name not a sample id", cfg: execagent.Config{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "my agent"}, Command: []string{"true"}}, field: "name"},
		{name: "negative max_line_bytes", cfg: execagent.Config{Command: []string{"true"}, MaxLineBytes: -1}, field: "max_line_bytes"},
		{name: "negative stderr_tail_bytes", cfg: execagent.Config{Command: []string{"true"}, StderrTailBytes: -1}, field: "stderr_tail_bytes"},
		{name: "negative kill grace", cfg: execagent.Config{Command: []string{"true"}, KillGrace: -time.Second}, field: "kill_grace"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wf, err := execagent.New(tc.cfg)
			var cfgErr *execagent.ConfigError
			if !errors.As(err, &cfgErr) || cfgErr.Field != tc.field {
				t.Fatalf("New = %v, %v; want a ConfigError for %s", wf, err, tc.field)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("error %v is not %v", err, tc.is)
			}
			if !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), tc.field) {
				t.Errorf("error %q does not name %s and say %q", err, tc.field, tc.msg)
			}
		})
	}
}

// TestScratchReachableByTheUser refuses a scratch base the run's user
// cannot enter: its start would fail with a bare "permission denied".
func TestScratchReachableByTheUser(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("user= needs a server running as root")
	}
	private := t.TempDir() // under the test's own 0700 directory
	cfg := execagent.Config{Command: []string{"true"}, ScratchDir: private, Limits: execagent.Limits{User: &execagent.RunAs{UID: 65534, GID: 65534}}}
	_, err := execagent.New(cfg)
	var cfgErr *execagent.ConfigError
	if !errors.As(err, &cfgErr) || cfgErr.Field != "scratch_dir" || !strings.Contains(err.Error(), filepath.Dir(private)) {
		t.Fatalf("New = %v, want a scratch_dir error naming %s", err, filepath.Dir(private))
	}
	for _, d := range []string{filepath.Dir(private), private} {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := execagent.New(cfg); err != nil {
		t.Errorf("New with a reachable scratch_dir: %v", err)
	}
}

func TestNewDefaults(t *testing.T) {
	t.Parallel()
	wf, err := execagent.New(execagent.Config{Command: []string{"sh", "-c", "true"}})
	if err != nil {
		t.Fatal(err)
	}
	if wf.Name() != execagent.DefaultName {
		t.Errorf("name %q, want %q", wf.Name(), execagent.DefaultName)
	}
	if err := wf.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
}
