//go:build unix

package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// faultPrompt is the task every misbehaving agent is given; faultLabel is
// its right answer, which the multiply grader looks for.
const (
	faultPrompt = "What is 6 times 7?"
	faultLabel  = "42"
)

// floodMiB is how much the flooding agent writes to stdout before its last
// line, and rssGrowthLimit how much the server's peak resident memory may
// grow meanwhile: far less than the flood, so output cannot be buffered.
const (
	floodMiB       = 64
	rssGrowthLimit = 24 << 20
)

// TestG2MisbehavingExecAgents runs exec agents that fail, print garbage,
// hang, flood their output or inspect their input under `osmo serve
// --exec`. Whatever the agent does, its rollout ends with exactly one
// completion and one grader callback with the right status and category:
// never a hang, a crash or a failure passed off as a reward of 0.
func TestG2MisbehavingExecAgents(t *testing.T) {
	for _, tc := range []struct {
		name string
		// agent is the script under testdata; .py scripts run with python3,
		// .sh scripts with sh.
		agent string
		// serve returns extra `osmo serve` arguments and environment for
		// the stack; nil means `--exec <agent> --grader multiply`.
		serve func(t *testing.T, agent []string, pidDir string) (args, env []string)
		// extra is laid over the start request.
		extra map[string]any
		check func(t *testing.T, s *g2Stack, f *faultRun)
	}{
		{name: "exit-1", agent: "exit_agent.sh", check: checkExitOne},
		{name: "garbage-no-llm", agent: "garbage_agent.sh", check: checkGarbageNoLLM},
		{name: "garbage-after-llm", agent: "garbage_llm_agent.py", check: checkGarbageAfterLLM},
		{
			name: "never-exits", agent: "sleep_agent.sh",
			extra: map[string]any{"agent_timeout_sec": 2},
			check: checkNeverExits,
		},
		{
			name: "floods-stdout", agent: "flood_agent.py",
			extra: map[string]any{"agent_timeout_sec": 30},
			check: checkFlood,
		},
		{
			name: "stdin-and-env", agent: "stdin_agent.py", serve: stdinServe,
			extra: map[string]any{
				"metadata":     map[string]any{"row": "r-7", "difficulty": "easy"},
				"extra_fields": map[string]any{"dataset": "faults"},
			},
			check: checkStdinAndEnv,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			agent := agentArgv(t, tc.agent)
			pidDir := t.TempDir()
			args := append([]string{"--exec", commandLine(agent), "--grader", "multiply"}, passEnv(t, "E2E_PID_DIR", "FLOOD_MIB")...)
			env := []string{"E2E_PID_DIR=" + pidDir, "FLOOD_MIB=" + strconv.Itoa(floodMiB)}
			if tc.serve != nil {
				args, env = tc.serve(t, agent, pidDir)
			}
			s := startG2(t, nil, env, args...)
			f := &faultRun{id: "fault-" + tc.name, pidDir: pidDir, start: time.Now()}
			if code, data := s.startRollout(t, f.id, faultPrompt, faultLabel, tc.extra); code != 202 {
				t.Fatalf("POST /rollout = %d %s", code, data)
			}
			tc.check(t, s, f)
			s.onlyOnce(t, f.id)
		})
	}
}

// faultRun is one rollout of a misbehaving agent.
type faultRun struct {
	id     string
	pidDir string
	// start is just before the rollout was started.
	start time.Time
}

func checkExitOne(t *testing.T, s *g2Stack, f *faultRun) {
	comp, grade := s.callbacks(t, f.id)
	msg := wantFailure(t, comp, grade, "agent_error")
	if !strings.Contains(msg, "boom: bad things") || !strings.Contains(msg, "status 1") {
		t.Errorf("err_message %q, want the exit status and the stderr tail %q", msg, "boom: bad things")
	}
	wantStatus(t, s, f.id, "failure")
}

func checkGarbageNoLLM(t *testing.T, s *g2Stack, f *faultRun) {
	comp, grade := s.callbacks(t, f.id)
	if msg := wantFailure(t, comp, grade, "agent_error"); !strings.Contains(msg, "no messages") {
		t.Errorf("err_message %q, want it to say the sample has no messages", msg)
	}
	if n := len(s.ctl.Chats()); n != 0 {
		t.Errorf("controller saw %d LLM calls, want none", n)
	}
}

func checkGarbageAfterLLM(t *testing.T, s *g2Stack, f *faultRun) {
	comp, grade := s.callbacks(t, f.id)
	sample := wantSuccess(t, comp, grade, "exec", 1)
	// The proxy's record stands for the conversation: the request's
	// messages and the policy's answer.
	if len(sample.Messages) != 2 {
		t.Fatalf("messages %v, want the user's task and the recorded answer", sample.Messages)
	}
	user, answer := sample.Messages[0], sample.Messages[1]
	if user["role"] != "user" || user["content"] != faultPrompt {
		t.Errorf("message 0 %v, want the user's task", user)
	}
	if text, _ := answer["content"].(string); answer["role"] != "assistant" || !strings.Contains(text, faultLabel) {
		t.Errorf("message 1 %v, want the recorded assistant answer with %s", answer, faultLabel)
	}
	if len(sample.LLMCalls) != 1 {
		t.Errorf("%d llm_calls, want the one the agent made", len(sample.LLMCalls))
	}
	chats := s.ctl.Chats()
	if len(chats) != 1 {
		t.Fatalf("controller saw %d LLM calls, want 1", len(chats))
	}
	if h := chats[0].Header; h.Get("X-Rollout-Id") != f.id || h.Get("X-Sample-Id") != "exec" || h.Get("Authorization") != "Bearer "+controllerKey {
		t.Errorf("LLM call headers %v", h)
	}
}

// checkNeverExits: the agent and its child ignore SIGTERM and sleep; the
// deadline must still end the rollout as a timeout promptly, and SIGKILL
// must take the whole process group.
func checkNeverExits(t *testing.T, s *g2Stack, f *faultRun) {
	const deadline = 2 * time.Second
	pids := waitPIDs(t, filepath.Join(f.pidDir, f.id))
	if len(pids) != 2 {
		t.Fatalf("pid file holds %v, want the agent and its child", pids)
	}
	comp, grade := s.callbacks(t, f.id)
	elapsed := time.Since(f.start)
	if elapsed < deadline || elapsed > deadline+5*time.Second {
		t.Errorf("completion after %s, want it within 5s after the %s deadline", elapsed.Round(time.Millisecond), deadline)
	}
	if msg := wantFailure(t, comp, grade, "timeout"); !strings.Contains(msg, "agent_timeout_sec") {
		t.Errorf("err_message %q, want it to name agent_timeout_sec", msg)
	}
	for _, pid := range pids {
		waitFor(t, fmt.Sprintf("process %d to be gone", pid), func() bool {
			return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
		})
	}
	gone := time.Since(f.start)
	t.Logf("completion %s and process group gone %s after the start, deadline %s", elapsed.Round(time.Millisecond), gone.Round(time.Millisecond), deadline)
	if gone > deadline+8*time.Second {
		t.Errorf("the process group outlived the deadline by %s", (gone - deadline).Round(time.Millisecond))
	}
	wantStatus(t, s, f.id, "failure")
}

// checkFlood: 64 MiB of stdout before the result line is read and dropped
// as it streams by; the server's peak memory barely moves.
func checkFlood(t *testing.T, s *g2Stack, f *faultRun) {
	pids := waitPIDs(t, filepath.Join(f.pidDir, f.id))
	if len(pids) != 1 {
		t.Fatalf("pid file holds %v, want the server's pid", pids)
	}
	serverPID := pids[0]
	rss := runtime.GOOS == "linux"
	var before int64
	if rss {
		if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", serverPID)); err != nil || exe != osmoBin {
			t.Fatalf("the agent's parent %d runs %q (%v), want the server %s", serverPID, exe, err, osmoBin)
		}
		before = peakRSS(t, serverPID)
	} else {
		t.Logf("no /proc on %s: the server's memory is not checked", runtime.GOOS)
	}
	if err := os.WriteFile(filepath.Join(f.pidDir, f.id+".go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	comp, grade := s.callbacks(t, f.id)
	sample := wantSuccess(t, comp, grade, "exec", 1)
	if len(sample.Messages) != 2 || sample.Messages[0]["content"] != faultPrompt || sample.Messages[1]["content"] != "6 times 7 is 42." {
		t.Errorf("messages %v, want those of the agent's last line", sample.Messages)
	}
	if rss {
		after := peakRSS(t, serverPID)
		t.Logf("server peak RSS %d KiB before the flood, %d KiB after", before>>10, after>>10)
		if after-before > rssGrowthLimit {
			t.Errorf("server peak RSS grew by %d MiB over a %d MiB flood, want under %d MiB", (after-before)>>20, floodMiB, rssGrowthLimit>>20)
		}
	}
}

// stdinServe runs the stdin agent from a workflow config, so it has
// settings (the "config" on stdin) and a name of its own (its sample id),
// and gives the server OPENAI_* and OSMOSIS_* variables that must not reach
// the agent.
func stdinServe(t *testing.T, agent []string, pidDir string) (args, env []string) {
	cfg, err := json.Marshal(map[string]any{
		"name":     "echo-agent",
		"command":  agent,
		"settings": map[string]any{"flavour": "plain", "max_turns": 3},
		"pass_env": []string{"E2E_PID_DIR"},
	})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "agent.json")
	if err := os.WriteFile(path, cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return []string{"--workflow", "exec", "--workflow-config", path, "--grader", "multiply"},
		[]string{"E2E_PID_DIR=" + pidDir, "OPENAI_API_KEY=sk-server-secret", "OPENAI_ORG_ID=org-leak", "OSMOSIS_E2E_LEAK=1"}
}

func checkStdinAndEnv(t *testing.T, s *g2Stack, f *faultRun) {
	const sampleID = "echo-agent"
	comp, grade := s.callbacks(t, f.id)
	sample := wantSuccess(t, comp, grade, sampleID, 1)
	x := sample.ExtraFields
	if x["dataset"] != "faults" {
		t.Errorf("extra_fields %v lost the request's", x)
	}

	raw, _ := x["stdin_raw"].(string)
	if !strings.HasSuffix(raw, "}\n") || strings.Count(raw, "\n") != 1 {
		t.Errorf("stdin %q, want one JSON object and a newline", raw)
	}
	if strings.Contains(raw, "label") || strings.Contains(raw, faultLabel) {
		t.Errorf("the label reached the agent's stdin: %s", raw)
	}
	var in struct {
		Prompt   []map[string]any `json:"prompt"`
		Metadata map[string]any   `json:"metadata"`
		Config   map[string]any   `json:"config"`
	}
	var keys map[string]json.RawMessage
	if err := json.Unmarshal([]byte(raw), &keys); err != nil || len(keys) != 3 {
		t.Errorf("stdin %s (%v), want exactly prompt, metadata and config", raw, err)
	}
	if err := json.Unmarshal([]byte(raw), &in); err != nil {
		t.Fatalf("stdin %q: %v", raw, err)
	}
	if len(in.Prompt) != 1 || in.Prompt[0]["role"] != "user" || in.Prompt[0]["content"] != faultPrompt {
		t.Errorf("stdin prompt %v, want the user's task", in.Prompt)
	}
	if in.Metadata["row"] != "r-7" || in.Metadata["difficulty"] != "easy" || len(in.Metadata) != 2 {
		t.Errorf("stdin metadata %v, want the request's", in.Metadata)
	}
	if in.Config["flavour"] != "plain" || in.Config["max_turns"] != float64(3) || len(in.Config) != 2 {
		t.Errorf("stdin config %v, want the workflow config's settings", in.Config)
	}

	env, _ := x["env"].(map[string]any)
	if env["OSMOSIS_ROLLOUT_ID"] != f.id || env["OSMOSIS_SAMPLE_ID"] != sampleID {
		t.Errorf("agent env ids %v %v, want %s %s", env["OSMOSIS_ROLLOUT_ID"], env["OSMOSIS_SAMPLE_ID"], f.id, sampleID)
	}
	base, _ := env["OPENAI_BASE_URL"].(string)
	if !strings.HasPrefix(base, "http://127.0.0.1:") || !strings.HasSuffix(base, "/r/"+f.id+"/s/"+sampleID+"/v1") || env["OSMOSIS_CHAT_COMPLETIONS_URL"] != base {
		t.Errorf("agent env OPENAI_BASE_URL %q OSMOSIS_CHAT_COMPLETIONS_URL %v, want the proxy bound to the rollout and sample", base, env["OSMOSIS_CHAT_COMPLETIONS_URL"])
	}
	if key, _ := env["OPENAI_API_KEY"].(string); key == "" || key == "sk-server-secret" || key == controllerKey {
		t.Errorf("agent env OPENAI_API_KEY %q, want a per-rollout token", key)
	}
	for _, k := range []string{"OPENAI_ORG_ID", "OSMOSIS_E2E_LEAK"} {
		if v, ok := env[k]; ok {
			t.Errorf("the server's %s=%v reached the agent", k, v)
		}
	}
}

// wantFailure checks a failed rollout's callbacks: the same status and
// category on both, and samples without rewards. It returns err_message.
func wantFailure(t *testing.T, comp, grade controller.G2Callback, category string) string {
	t.Helper()
	if comp.Status != "failure" || comp.ErrCategory == nil || *comp.ErrCategory != category || comp.ErrMessage == nil {
		t.Fatalf("completion %s, want failure with err_category %s", comp.Raw, category)
	}
	if grade.Status != "failure" || grade.ErrCategory == nil || *grade.ErrCategory != category || grade.ErrMessage == nil || *grade.ErrMessage != *comp.ErrMessage {
		t.Errorf("grader callback %s, want the completion's failure", grade.Raw)
	}
	for id, sm := range grade.Samples {
		if sm.Reward != nil {
			t.Errorf("sample %s of a failed rollout has reward %v, want none", id, *sm.Reward)
		}
	}
	return *comp.ErrMessage
}

// wantSuccess checks a successful rollout's callbacks and returns its only
// sample, sampleID, after checking its reward.
func wantSuccess(t *testing.T, comp, grade controller.G2Callback, sampleID string, reward float64) controller.G2Sample {
	t.Helper()
	if comp.Status != "success" || comp.ErrMessage != nil || comp.ErrCategory != nil {
		t.Fatalf("completion %s, want success", comp.Raw)
	}
	sample, ok := grade.Samples[sampleID]
	if grade.Status != "success" || !ok || len(grade.Samples) != 1 {
		t.Fatalf("grader callback %s, want success with sample %s alone", grade.Raw, sampleID)
	}
	if sample.Reward == nil || *sample.Reward != reward {
		t.Errorf("reward %v, want %v", sample.Reward, reward)
	}
	if sample.Label == nil || *sample.Label != faultLabel {
		t.Errorf("sample label %v, want %q", sample.Label, faultLabel)
	}
	return sample
}

// wantStatus polls GET /rollout/{id}/status until it says want: the
// callbacks are posted before the rollout's final state is recorded.
func wantStatus(t *testing.T, s *g2Stack, id, want string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		code, _, st := do(t, "GET", s.base+"/rollout/"+id+"/status", "Bearer "+serverKey, "")
		if code == 200 && st["status"] == want {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("status of %s: %d %v, want %s", id, code, st, want)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// agentArgv is the command running testdata/script: python3 for .py, sh
// for .sh.
func agentArgv(t *testing.T, script string) []string {
	t.Helper()
	interp := "sh"
	if strings.HasSuffix(script, ".py") {
		interp = "python3"
	}
	bin, err := exec.LookPath(interp)
	if err != nil {
		t.Fatalf("%s is needed for %s: %v", interp, script, err)
	}
	abs, err := filepath.Abs(filepath.Join("testdata", script))
	if err != nil {
		t.Fatal(err)
	}
	return []string{bin, abs}
}

// commandLine quotes argv for --exec, whose line is split like a shell's.
func commandLine(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

// peakRSS is the peak resident set size (VmHWM) of process pid, in bytes.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		rest, ok := strings.CutPrefix(line, "VmHWM:")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
		if err != nil {
			t.Fatalf("VmHWM line %q: %v", line, err)
		}
		return kb << 10
	}
	t.Fatalf("no VmHWM in /proc/%d/status", pid)
	return 0
}

// passEnv returns the arguments that pass the server's variables names to
// its exec agents, which get only an allowlist of the server's environment
// otherwise.
func passEnv(t *testing.T, names ...string) []string {
	t.Helper()
	cfg, err := json.Marshal(map[string]any{"pass_env": names})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "pass-env.json")
	if err := os.WriteFile(path, cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return []string{"--workflow-config", path}
}
