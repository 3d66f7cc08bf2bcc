//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/eval"
)

// copyWorkspace copies the example Osmosis workspace (a stand-in
// create_rollout_server app in rollouts/multiply/main.py, both config
// generations, data/) into a temporary directory the test may change.
func copyWorkspace(t *testing.T) string {
	t.Helper()
	src := filepath.Join("..", "examples", "osmosis-workspace")
	dst := t.TempDir()
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, path)
		if d.IsDir() {
			if d.Name() == ".osmosis" || d.Name() == "__pycache__" {
				return filepath.SkipDir
			}
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

// wsEval runs `osmo eval run` in the workspace ws with env added.
func wsEval(t *testing.T, ws string, env []string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, osmoBin, append([]string{"eval", "run"}, args...)...)
	cmd.Dir = ws
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("osmo eval run: %v\n%s", err, out)
	}
	return cmd.ProcessState.ExitCode(), string(out)
}

// TestOsmosisWorkspaceEval runs an Osmosis workspace as its users have
// it, unchanged: both config generations, the rollout server started by
// osmo from its entrypoint, the secrets from --secrets-file kept out of
// every file osmo writes, and a run that pins what it ran.
func TestOsmosisWorkspaceEval(t *testing.T) {
	ws := copyWorkspace(t)
	secret := "sekrit-" + fmt.Sprint(time.Now().UnixNano())
	secrets := filepath.Join(t.TempDir(), "secrets.env")
	if err := os.WriteFile(secrets, []byte("MULTIPLY_SECRET="+secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	runs := filepath.Join(ws, ".osmosis", "evals")
	// The server is asked to leak the secret (into its output and the
	// sample's conversation): osmo must not write it anywhere.
	leak := []string{"MULTIPLY_ECHO_SECRET=1"}

	code, out := wsEval(t, ws, leak, "configs/eval/multiply.toml", "--mock", "--secrets-file", secrets, "--name", "first", "-y")
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	dir := filepath.Join(runs, "first")
	results := readResults(t, dir)
	if len(results) != 20 {
		t.Fatalf("%d results, want 20 (20 rows × 1 run):\n%s", len(results), out)
	}
	for _, r := range results {
		if r.Status != eval.StatusSuccess || r.Reward == nil || *r.Reward != 1 {
			t.Errorf("row %d: %s %v %s: %s", r.RowIndex, r.Status, r.Reward, r.ErrCategory, r.ErrMessage)
		}
	}
	var m eval.Manifest
	b, err := os.ReadFile(filepath.Join(dir, eval.ManifestFile))
	if err != nil || json.Unmarshal(b, &m) != nil {
		t.Fatalf("manifest: %v\n%s", err, b)
	}
	in := m.Inputs
	if m.SchemaVersion != 1 || m.RunName != "first" || in.ModelPath != "openai/gpt-4o-mini" || in.N != 1 ||
		in.Rollout.Name != "multiply" || in.Rollout.Entrypoint != "main.py" || len(in.Rollout.SourceDigest) != 64 ||
		in.Dataset.SelectedSourceRows != "0-19" || len(in.Dataset.SHA256) != 64 ||
		strings.Join(in.SecretNames, ",") != "MULTIPLY_SECRET" || in.Env["MULTIPLY_GREETING"] == "" {
		t.Errorf("manifest: %s", b)
	}
	logs, err := os.ReadFile(filepath.Join(dir, "logs.txt"))
	if err != nil || !strings.Contains(string(logs), eval.Redacted) {
		t.Errorf("logs.txt holds no redacted secret (%v):\n%s", err, logs)
	}
	assertNoSecret(t, ws, secret)
	if strings.Contains(out, secret) {
		t.Errorf("osmo printed the secret:\n%s", out)
	}

	// The v0.2-era file of the same workspace runs too (it has no
	// [secrets]: the value comes from the environment).
	code, out = wsEval(t, ws, []string{"MULTIPLY_SECRET=" + secret}, "configs/eval/multiply-v02.toml", "--mock", "--name", "old")
	if code != 0 {
		t.Fatalf("v0.2 config: exit %d:\n%s", code, out)
	}
	if rs := readResults(t, filepath.Join(runs, "old")); len(rs) != 20 || rs[0].Status != eval.StatusSuccess {
		t.Errorf("v0.2 config: %d results", len(rs))
	}

	// Without the secret, the run is refused before anything starts.
	code, out = wsEval(t, ws, nil, "configs/eval/multiply.toml", "--mock", "--name", "nosecret")
	if code != 2 || !strings.Contains(out, "MULTIPLY_SECRET") {
		t.Errorf("no secret: exit %d:\n%s", code, out)
	}
	// With --json, the refusal is the Osmosis CLI's error envelope, alone.
	code, out = wsEval(t, ws, nil, "configs/eval/multiply.toml", "--mock", "--name", "nosecret", "--json")
	var env struct {
		SchemaVersion int    `json:"schema_version"`
		Command       string `json:"command"`
		Error         struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &env); err != nil || code != 2 || env.SchemaVersion != 1 || env.Command != "eval run" ||
		env.Error.Code != "VALIDATION" || !strings.Contains(env.Error.Message, "MULTIPLY_SECRET") {
		t.Errorf("no secret, --json: exit %d, %v:\n%s", code, err, out)
	}

	// The dataset edited: resuming "first" is refused, naming what changed.
	data := filepath.Join(ws, "data", "multiply.jsonl")
	orig, _ := os.ReadFile(data)
	if err := os.WriteFile(data, append(orig, []byte(`{"user_prompt":"What is 2 times 2?","ground_truth":"4"}`+"\n")...), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out = wsEval(t, ws, nil, "configs/eval/multiply.toml", "--mock", "--secrets-file", secrets, "--name", "first")
	if code != 2 || !strings.Contains(out, "Changed: dataset") || !strings.Contains(out, "--fresh") {
		t.Errorf("edited dataset: exit %d, want 2 naming the dataset:\n%s", code, out)
	}
	// --fresh archives the old run and runs the new inputs.
	code, out = wsEval(t, ws, nil, "configs/eval/multiply.toml", "--mock", "--secrets-file", secrets, "--name", "first", "--fresh")
	if code != 0 {
		t.Fatalf("--fresh: exit %d:\n%s", code, out)
	}
	archived, _ := filepath.Glob(filepath.Join(runs, "first.archive-*"))
	if len(archived) != 1 || len(readResults(t, archived[0])) != 20 || len(readResults(t, dir)) != 21 {
		t.Errorf("--fresh: archives %v", archived)
	}
	assertNoSecret(t, ws, secret)
}

// assertNoSecret fails when any file under dir holds secret.
func assertNoSecret(t *testing.T, dir, secret string) {
	t.Helper()
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if b, _ := os.ReadFile(path); strings.Contains(string(b), secret) {
			t.Errorf("%s holds the secret's value", path)
		}
		return nil
	})
}

// TestOsmosisWorkspaceEvalResumesAfterKill: the workspace's eval killed
// with SIGKILL halfway (osmo and, with it, the rollout server it started)
// and run again finishes every attempt once, and no finished attempt
// reaches the model again.
func TestOsmosisWorkspaceEvalResumesAfterKill(t *testing.T) {
	ws := copyWorkspace(t)
	policy := newCountingPolicy(t, 50*time.Millisecond)
	env := []string{"MULTIPLY_SECRET=s", "OPENAI_BASE_URL=" + policy.srv.URL + "/v1", "OPENAI_API_KEY=k"}
	dir := filepath.Join(ws, ".osmosis", "evals", "half")
	cmd := exec.Command(osmoBin, "eval", "run", "configs/eval/multiply.toml", "--name", "half", "--max-in-flight", "2")
	// A TMPDIR of the test's: the killed process leaves its embedded
	// state server's directory behind.
	cmd.Dir, cmd.Env = ws, append(os.Environ(), append(env, "TMPDIR="+t.TempDir())...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(dir, eval.ResultsFile))
		if n := strings.Count(string(b), "\n"); n >= 6 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	first := readResults(t, dir)
	if len(first) == 0 || len(first) >= 20 {
		t.Fatalf("%d results when killed, want some but not all", len(first))
	}
	finished := map[string]bool{}
	for _, r := range first {
		finished[r.RolloutID] = true
	}
	before, _ := policy.snapshot()

	code, out := wsEval(t, ws, env, "configs/eval/multiply.toml", "--name", "half")
	if code != 0 {
		t.Fatalf("resume: exit %d:\n%s", code, out)
	}
	results := readResults(t, dir)
	seen := map[eval.Key]int{}
	for _, r := range results {
		seen[r.Key()]++
	}
	if len(seen) != 20 || len(results) != 20 {
		t.Errorf("%d results for %d attempts after the resume, want one for each of 20", len(results), len(seen))
	}
	after, _ := policy.snapshot()
	for id, n := range after {
		if finished[id] && n != before[id] {
			t.Errorf("the resume called the model for %s, which had finished", id)
		}
	}
}
