package eval

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Layout is where a config's rollout, dataset and runs are, resolved as
// the Osmosis SDK resolves them in a workspace (rollouts/, configs/eval/,
// data/), and as osmo always has outside one.
type Layout struct {
	// Workspace is the workspace root; "" when the config is in none.
	Workspace string
	// RolloutDir is rollouts/NAME when the rollout is the workspace's (an
	// Osmosis rollout server to start), "" for a workflow of this binary
	// or an exec agent; Entrypoint is the server's file within it.
	RolloutDir, Entrypoint string
	DatasetPath            string
	// OutputRoot holds a directory per run.
	OutputRoot string
}

// Workspace subdirectories, as the SDK's scaffold lays them out.
const (
	rolloutsDir   = "rollouts"
	dataDir       = "data"
	evalConfigDir = "configs/eval"
	outputSubdir  = ".osmosis/evals"
)

// FindWorkspace returns the workspace a config belongs to: the directory
// holding configs/eval/ when the config is there, else the nearest
// ancestor of the config holding rollouts/ROLLOUT; "" when none does.
func FindWorkspace(configPath, rollout string) string {
	abs, err := filepath.Abs(configPath)
	if err != nil {
		return ""
	}
	dir := filepath.Dir(abs)
	if filepath.Base(dir) == "eval" && filepath.Base(filepath.Dir(dir)) == "configs" {
		return filepath.Dir(filepath.Dir(dir))
	}
	if rollout == "" || !singleSegment(rollout) {
		return ""
	}
	for d := dir; ; d = filepath.Dir(d) {
		if fi, err := os.Stat(filepath.Join(d, rolloutsDir, rollout)); err == nil && fi.IsDir() {
			return d
		}
		if filepath.Dir(d) == d {
			return ""
		}
	}
}

func singleSegment(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, `/\`+"\x00")
}

// Resolve finds the config's rollout, dataset and output root.
// datasetFile (--dataset-file) and outputRoot (-o) override the config;
// relative paths in them are relative to the working directory, those in
// the config to the config's directory, then to the workspace.
func (c *Config) Resolve(datasetFile, outputRoot string) (*Layout, error) {
	l := &Layout{Workspace: FindWorkspace(c.Path, c.Experiment.Rollout)}
	configDir, err := filepath.Abs(filepath.Dir(c.Path))
	if err != nil {
		return nil, err
	}
	sec := c.section()
	if err := l.resolveRollout(c, sec); err != nil {
		return nil, err
	}
	if l.DatasetPath, err = c.resolveDataset(datasetFile, configDir, l.Workspace, sec); err != nil {
		return nil, err
	}
	base := cmp.Or(l.Workspace, configDir)
	switch {
	case outputRoot != "":
		l.OutputRoot, err = filepath.Abs(outputRoot)
	case c.Output.Path != "" && filepath.IsAbs(c.Output.Path):
		l.OutputRoot = c.Output.Path
	case c.Output.Path != "":
		l.OutputRoot = filepath.Join(base, c.Output.Path)
	default:
		l.OutputRoot = filepath.Join(base, outputSubdir)
	}
	if err != nil {
		return nil, err
	}
	if l.RolloutDir != "" && l.OutputRoot == l.RolloutDir {
		return nil, &ConfigError{Path: c.Path, Msg: fmt.Sprintf("-o must not be the rollout's own directory %s: its source digest pins the run", l.RolloutDir)}
	}
	return l, nil
}

// resolveRollout checks the rollout name as the SDK does and, in a
// workspace that has rollouts/NAME, points at its server's entrypoint.
func (l *Layout) resolveRollout(c *Config, sec string) error {
	name := c.Experiment.Rollout
	bad := func(format string, args ...any) error {
		return &ConfigError{Path: c.Path, Key: sec + ".rollout", Msg: fmt.Sprintf(format, args...)}
	}
	if l.Workspace == "" || name == "exec" {
		return nil
	}
	if filepath.IsAbs(name) {
		return bad("must be a logical rollout name, not a path")
	}
	if !singleSegment(name) {
		return bad("%q must be a single-segment name (no path separators)", name)
	}
	dir := filepath.Join(l.Workspace, rolloutsDir, name)
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return nil // not the workspace's: a workflow of this binary, checked by the caller
	}
	ep := cmp.Or(c.Experiment.Entrypoint, DefaultEntrypoint)
	path := filepath.Join(dir, ep)
	if rel, err := filepath.Rel(dir, path); err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return &ConfigError{Path: c.Path, Key: sec + ".entrypoint", Msg: "must resolve under rollouts/<rollout>/ within the workspace"}
	}
	if fi, err := os.Stat(path); err != nil || fi.IsDir() {
		return &ConfigError{Path: c.Path, Key: sec + ".entrypoint", Msg: fmt.Sprintf("%s is not a file in %s", ep, dir)}
	}
	l.RolloutDir, l.Entrypoint = dir, ep
	return nil
}

// resolveDataset finds the dataset: --dataset-file, else the config's
// dataset as a path (relative to the config, then the workspace), else
// as the name of a file under the workspace's data/ (today's SDK names a
// platform dataset there: a local copy of it stands in).
func (c *Config) resolveDataset(flag, configDir, ws, sec string) (string, error) {
	if flag != "" {
		p, err := filepath.Abs(flag)
		if err != nil {
			return "", err
		}
		if fi, err := os.Stat(p); err != nil || fi.IsDir() {
			return "", fmt.Errorf("--dataset-file: %s is not a file", flag)
		}
		return p, nil
	}
	name := c.Experiment.Dataset
	cands := []string{name}
	if !filepath.IsAbs(name) {
		cands = []string{filepath.Join(configDir, name)}
		if ws != "" {
			cands = append(cands, filepath.Join(ws, name), filepath.Join(ws, dataDir, name))
			if filepath.Ext(name) == "" {
				for _, ext := range []string{".jsonl", ".csv", ".parquet"} {
					cands = append(cands, filepath.Join(ws, dataDir, name+ext))
				}
			}
		}
	}
	var tried []string
	for _, p := range slices.Compact(cands) {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
			return p, nil
		}
		tried = append(tried, p)
	}
	return "", &ConfigError{Path: c.Path, Key: sec + ".dataset", Msg: fmt.Sprintf(
		"%q is no local file (tried %s); osmo runs offline: pass --dataset-file PATH, or put the rows in data/%s.jsonl",
		name, strings.Join(tried, ", "), strings.TrimSuffix(filepath.Base(name), filepath.Ext(name)))}
}
