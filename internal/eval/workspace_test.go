package eval_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/eval"
)

// workspace lays out an Osmosis workspace as the SDK's scaffold does and
// returns its root.
func workspace(t *testing.T) string {
	t.Helper()
	ws := t.TempDir()
	for _, d := range []string{"rollouts/calc", "configs/eval", "data"} {
		if err := os.MkdirAll(filepath.Join(ws, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write(t, filepath.Join(ws, "rollouts/calc"), "main.py", "print('serve')\n")
	write(t, filepath.Join(ws, "rollouts/calc"), "pyproject.toml", "[project]\nname = \"calc\"\n")
	write(t, filepath.Join(ws, "data"), "calc.jsonl", `{"user_prompt":"What is 2 times 3?","ground_truth":"6"}`+"\n")
	return ws
}

const currentTOML = `[experiment]
rollout = "calc"
entrypoint = "main.py"
model_path = "openai/gpt-5-mini"
dataset = "calc"
# branch = "x"

[evaluation]
n = 2
batch_size = 4

[env]
LOG_LEVEL = "INFO"

[advanced]
anything = { goes = true }

[secrets]
required = ["OPENAI_API_KEY", "CALC_TOKEN"]
`

const v02TOML = `[eval]
rollout = "calc"
entrypoint = "main.py"
dataset = "data/calc.jsonl"
limit = 5
offset = 1
fresh = false
retry_failed = true

[llm]
model = "openai/gpt-4o-mini"
base_url = "http://127.0.0.1:1/v1"
api_key_env = "MY_KEY"

[runs]
n = 3
pass_threshold = 0.5

[timeouts]
agent_workflow_timeout_s = 60
grader_timeout_s = 20

[output]
log_samples = true
quiet = false
`

func TestConfigGenerationsInAWorkspace(t *testing.T) {
	ws := workspace(t)
	cur, err := eval.LoadConfig(write(t, filepath.Join(ws, "configs/eval"), "calc.toml", currentTOML))
	if err != nil {
		t.Fatal(err)
	}
	old, err := eval.LoadConfig(write(t, filepath.Join(ws, "configs/eval"), "calc-v02.toml", v02TOML))
	if err != nil {
		t.Fatal(err)
	}
	if cur.Generation != eval.GenerationCurrent || old.Generation != eval.GenerationV02 {
		t.Fatalf("generations %q %q", cur.Generation, old.Generation)
	}
	if cur.Evaluation.N != 2 || cur.Evaluation.BatchSize != 4 || cur.Env["LOG_LEVEL"] != "INFO" ||
		strings.Join(cur.Secrets, ",") != "OPENAI_API_KEY,CALC_TOKEN" || cur.Advanced["anything"] == nil || cur.Model() != "gpt-5-mini" {
		t.Errorf("current: %+v", cur)
	}
	ov := old.Evaluation
	if ov.N != 3 || ov.BatchSize != 1 || ov.Limit != 5 || ov.Offset != 1 || *ov.PassThreshold != 0.5 || *ov.AgentTimeoutS != 60 ||
		*ov.GraderTimeoutS != 20 || !old.RetryFailed || old.LLM.APIKeyEnv != "MY_KEY" || old.Model() != "gpt-4o-mini" || !old.Output.LogSamples {
		t.Errorf("v0.2: %+v %+v", old, ov)
	}
	for _, c := range []*eval.Config{cur, old} {
		l, err := c.Resolve("", "")
		if err != nil {
			t.Fatalf("%s: %v", c.Path, err)
		}
		if l.Workspace != ws || l.RolloutDir != filepath.Join(ws, "rollouts/calc") || l.Entrypoint != "main.py" ||
			l.DatasetPath != filepath.Join(ws, "data/calc.jsonl") || l.OutputRoot != filepath.Join(ws, ".osmosis/evals") {
			t.Errorf("%s: layout %+v", c.Path, l)
		}
	}
	// --dataset-file and -o win over the config.
	other := write(t, t.TempDir(), "other.csv", "user_prompt,ground_truth\nq,1\n")
	l, err := cur.Resolve(other, filepath.Join(ws, "out"))
	if err != nil || l.DatasetPath != other || l.OutputRoot != filepath.Join(ws, "out") {
		t.Errorf("overrides: %+v %v", l, err)
	}
}

func TestConfigErrorsNameFileLineAndKey(t *testing.T) {
	ws := workspace(t)
	dir := filepath.Join(ws, "configs/eval")
	for _, tc := range []struct{ name, text, want string }{
		{"unknown section", currentTOML + "\n[training]\nlr = 1\n", ":21: training: unknown section"},
		{"unknown key", strings.Replace(currentTOML, "n = 2", "n = 2\nbatchsize = 3", 1), ":10: evaluation.batchsize: unknown key"},
		{"mixed generations", currentTOML + "\n[runs]\nn = 1\n", "mixes two config generations: [experiment], [evaluation], [env], [secrets], [advanced] are today's, [runs]"},
		{"secrets without required", strings.Replace(currentTOML, `required = ["OPENAI_API_KEY", "CALC_TOKEN"]`, "", 1), "secrets.required: Missing 'required'"},
		{"secret in env too", strings.Replace(currentTOML, `LOG_LEVEL = "INFO"`, `CALC_TOKEN = "x"`, 1), "CALC_TOKEN appears in both [env] and [secrets]"},
		{"bad secret name", strings.Replace(currentTOML, `"CALC_TOKEN"`, `"calc_token"`, 1), "Invalid secret name 'calc_token'"},
		{"duplicate secret", strings.Replace(currentTOML, `"CALC_TOKEN"`, `"OPENAI_API_KEY"`, 1), "Duplicate secret name OPENAI_API_KEY"},
		{"reserved env", strings.Replace(currentTOML, `LOG_LEVEL = "INFO"`, `_OSMOSIS_X = "1"`, 1), "env._OSMOSIS_X: env var names starting with _OSMOSIS_ are reserved"},
		{"env not a string", strings.Replace(currentTOML, `LOG_LEVEL = "INFO"`, `LOG_LEVEL = 3`, 1), ":13: env.LOG_LEVEL: must be a string"},
		{"branch and commit", strings.Replace(currentTOML, `# branch = "x"`, "branch = \"x\"\ncommit_sha = \"abcdef1\"", 1), "experiment.commit_sha: Provide either branch or commit_sha, not both"},
		{"bad commit", strings.Replace(currentTOML, `# branch = "x"`, `commit_sha = "xyz"`, 1), "experiment.commit_sha: must be a hexadecimal Git commit SHA"},
		{"v0.2 without model", strings.Replace(v02TOML, `model = "openai/gpt-4o-mini"`, "", 1), "llm.model: required"},
		{"v0.2 threshold", strings.Replace(v02TOML, "pass_threshold = 0.5", "pass_threshold = 2.0", 1), ":17: runs.pass_threshold: must be between 0 and 1"},
		{"v0.2 unknown key", strings.Replace(v02TOML, "quiet = false", "quiet = false\nverbose = true", 1), "output.verbose: unknown key (this v0.2-era file's sections"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := write(t, dir, "bad.toml", tc.text)
			_, err := eval.LoadConfig(path)
			var ce *eval.ConfigError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), path) {
				t.Fatalf("err = %v, want a ConfigError naming %s and %q", err, path, tc.want)
			}
		})
	}
	// The rollout and dataset must be found.
	for _, tc := range []struct{ name, from, to, want string }{
		{"rollout path", `rollout = "calc"`, `rollout = "../calc"`, `experiment.rollout: "../calc" must be a single-segment name`},
		{"entrypoint outside", `entrypoint = "main.py"`, `entrypoint = "../../x.py"`, "experiment.entrypoint: must resolve under rollouts/<rollout>/"},
		{"missing entrypoint", `entrypoint = "main.py"`, `entrypoint = "app.py"`, "experiment.entrypoint: app.py is not a file"},
		{"platform dataset", `dataset = "calc"`, `dataset = "gsm8k-v2"`, `experiment.dataset: "gsm8k-v2" is no local file`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := eval.LoadConfig(write(t, dir, "bad.toml", strings.Replace(currentTOML, tc.from, tc.to, 1)))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.Resolve("", ""); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestSecrets(t *testing.T) {
	file := write(t, t.TempDir(), "secrets.env", "# comment\nexport CALC_TOKEN='s3cr3t-value'\nOTHER=\"x y\" \n\nEMPTY=\n")
	env := map[string]string{"OPENAI_API_KEY": "sk-from-env", "CALC_TOKEN": "not-this"}
	got, err := eval.ResolveSecrets([]string{"OPENAI_API_KEY", "CALC_TOKEN"}, file, nil, func(k string) string { return env[k] }, nil)
	if err != nil || got["CALC_TOKEN"] != "s3cr3t-value" || got["OPENAI_API_KEY"] != "sk-from-env" {
		t.Fatalf("got %v, %v", got, err)
	}
	_, err = eval.ResolveSecrets([]string{"EMPTY", "NOWHERE", "OPENAI_API_KEY"}, file, nil, func(string) string { return "" }, []string{"OPENAI_API_KEY"})
	var se *eval.SecretsError
	if !errors.As(err, &se) || strings.Join(se.Missing, ",") != "EMPTY,NOWHERE" || !strings.Contains(err.Error(), file) {
		t.Fatalf("err = %v", err)
	}
	bad := write(t, t.TempDir(), "bad.env", "just-a-secret-pasted-here\n")
	if _, err := eval.ResolveSecrets([]string{"X"}, bad, nil, func(string) string { return "" }, nil); err == nil ||
		strings.Contains(err.Error(), "just-a-secret") || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("a malformed line: err = %v (it must not repeat the line)", err)
	}
	r := eval.NewRedactor("s3cr3t", "s3cr3t-value", "")
	if got := r.String("token=s3cr3t-value and s3cr3t."); got != "token=[REDACTED] and [REDACTED]." {
		t.Errorf("redacted %q", got)
	}
}

func TestOpenRunPinsResumesArchivesAndLocks(t *testing.T) {
	root := t.TempDir()
	in := eval.Inputs{ModelPath: "openai/m", Dataset: eval.DatasetInput{SHA256: "aa", SelectedSourceRows: eval.FormatRows([]int{0, 1, 2, 5, 7, 8})},
		N: 2, Rollout: eval.RolloutInput{Name: "calc", Entrypoint: "main.py", SourceDigest: "bb"},
		Env: map[string]string{}, SecretNames: []string{}, Versions: eval.Versions()}
	if in.Dataset.SelectedSourceRows != "0-2,5,7-8" {
		t.Fatalf("rows %q", in.Dataset.SelectedSourceRows)
	}
	t0 := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	rd, err := eval.OpenRun(eval.OpenRunOptions{Root: root, Stem: "calc", Inputs: in, Now: t0})
	if err != nil || !rd.Created || !strings.HasPrefix(rd.Name, "calc-20261125T100000Z-") || len(rd.Name) != len("calc-20261125T100000Z-")+8 {
		t.Fatalf("open: %+v %v", rd, err)
	}
	// One process per run: a second open is refused, naming the holder.
	_, err = eval.OpenRun(eval.OpenRunOptions{Root: root, Name: rd.Name, Stem: "calc", Inputs: in})
	var le *eval.RunLockedError
	if !errors.As(err, &le) || !strings.Contains(err.Error(), "pid ") || !strings.Contains(err.Error(), rd.Name+".lock") {
		t.Fatalf("second open: %v", err)
	}
	if err := os.WriteFile(filepath.Join(rd.Path, "results.jsonl"), []byte("{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rd.Close()
	// Unnamed again, same inputs: the same run, resumed.
	again, err := eval.OpenRun(eval.OpenRunOptions{Root: root, Stem: "calc", Inputs: in, Now: t0.Add(time.Hour)})
	if err != nil || again.Name != rd.Name || again.Created || again.Manifest.LocalRunID != rd.Manifest.LocalRunID {
		t.Fatalf("resume: %+v %v", again, err)
	}
	again.Close()
	// Named, with changed inputs: refused, naming what changed.
	changed := in
	changed.Dataset.SHA256, changed.N = "cc", 3
	_, err = eval.OpenRun(eval.OpenRunOptions{Root: root, Name: rd.Name, Stem: "calc", Inputs: changed})
	var re *eval.ResumeRefusedError
	if !errors.As(err, &re) || strings.Join(re.Changed, ",") != "dataset,n" || !strings.Contains(err.Error(), "--fresh") {
		t.Fatalf("changed: %v", err)
	}
	// --fresh archives, never deletes.
	fresh, err := eval.OpenRun(eval.OpenRunOptions{Root: root, Name: rd.Name, Stem: "calc", Inputs: changed, Fresh: true, Now: t0.Add(2 * time.Hour)})
	if err != nil || !fresh.Created || fresh.Archived != rd.Path+".archive-20261125T120000Z" {
		t.Fatalf("fresh: %+v %v", fresh, err)
	}
	fresh.Close()
	if b, err := os.ReadFile(filepath.Join(fresh.Archived, "results.jsonl")); err != nil || string(b) != "{}\n" {
		t.Fatalf("the archived results: %q %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(fresh.Path, "results.jsonl")); !os.IsNotExist(err) {
		t.Fatalf("the fresh run holds old results: %v", err)
	}
	for _, bad := range []string{"../x", ".hidden", "a/b", ".locks", strings.Repeat("x", 97)} {
		if _, err := eval.OpenRun(eval.OpenRunOptions{Root: root, Name: bad, Inputs: in}); err == nil {
			t.Errorf("run name %q accepted", bad)
		}
	}
}

func TestSourceDigestSkipsEnvironments(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "main.py", "a")
	d1, err := eval.SourceDigest(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{".venv/lib.py", "__pycache__/m.pyc", "x.egg-info/PKG", "uv.lock"} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		write(t, dir, p, "env")
	}
	if d2, _ := eval.SourceDigest(dir, ""); d2 != d1 {
		t.Errorf("environment files changed the digest")
	}
	write(t, dir, "main.py", "b")
	if d3, _ := eval.SourceDigest(dir, ""); d3 == d1 {
		t.Errorf("an edit left the digest unchanged")
	}
}

func TestDatasetSelectionAsTheSDK(t *testing.T) {
	dir := t.TempDir()
	p := write(t, dir, "m.jsonl", `{"user_prompt":"a","ground_truth":"1"}
{"metadata":{"task":"t1"}}
{"metadata":{},"user_prompt":"c"}
{"metadata":{}}
{"user_prompt":"e"}
`)
	d, err := eval.ReadDataset(p)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := d.Select("1,2,4", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3 || rows[0].Index != 0 || rows[0].SourceIndex != 1 || rows[2].Index != 2 || rows[2].SourceIndex != 4 ||
		len(rows[0].Messages) != 0 || rows[0].Metadata["task"] != "t1" || rows[1].Metadata != nil || rows[1].Messages[0]["content"] != "c" {
		t.Fatalf("rows %+v", rows)
	}
	// A metadata-only row with {} has nothing to run.
	if _, err := d.Select("3", 0, 0); err == nil || !strings.Contains(err.Error(), "row 3: has no prompt and no metadata") {
		t.Fatalf("empty row: %v", err)
	}
	if _, err := d.Select("9", 0, 0); err == nil || !strings.Contains(err.Error(), "valid indices are 0-4") {
		t.Fatalf("out of range: %v", err)
	}
	// A file without a metadata column needs user_prompt on each row run,
	// and only on those.
	p2 := write(t, dir, "p.jsonl", "{\"user_prompt\":\"a\"}\n{\"question\":\"b\"}\n")
	d2, _ := eval.ReadDataset(p2)
	if rows, err := d2.Select("", 0, 1); err != nil || len(rows) != 1 {
		t.Fatalf("limit 1: %v", err)
	}
	if _, err := d2.Select("", 0, 0); err == nil || !strings.Contains(err.Error(), "row 1: user_prompt: missing") {
		t.Fatalf("no prompt: %v", err)
	}
}

func TestRedactorKeepsJSONWhole(t *testing.T) {
	r := eval.NewRedactor("s")
	doc := []byte(`{"status":"success","messages":[{"role":"user","content":"s3cret is s"}]}`)
	got := string(r.JSON(doc))
	if got != `{"messages":[{"content":"[REDACTED]3cret i[REDACTED] [REDACTED]","role":"u[REDACTED]er"}],"status":"[REDACTED]ucce[REDACTED][REDACTED]"}` {
		t.Errorf("redacted %s", got)
	}
	clean := []byte(`{"b": 1,  "a": "x"}`)
	if got := r.JSON(clean); string(got) != string(clean) {
		t.Errorf("a document without the secret was rewritten: %s", got)
	}
}
