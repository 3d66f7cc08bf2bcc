package eval

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The run directory's pinned inputs, as the Osmosis SDK writes them. The
// versions are bumped when the meaning of the files a resume reads, or of
// a row_index, changes; the protocol is the wire the runner speaks.
const (
	ManifestFile                = "manifest.json"
	StateSchemaVersion          = 1
	DatasetNormalizationVersion = 1
	RolloutProtocolVersion      = "0.3"
	locksDir                    = ".locks"
	maxRunName                  = 96
)

// Inputs is what a run ran: a resume whose inputs differ in any key
// refuses, naming the keys. Only what changes results is here (not the run
// name, the output root, batch_size or pass_threshold).
type Inputs struct {
	ModelPath   string            `json:"model_path"`
	Dataset     DatasetInput      `json:"dataset"`
	N           int               `json:"n"`
	Rollout     RolloutInput      `json:"rollout"`
	Env         map[string]string `json:"env"`
	SecretNames []string          `json:"secret_names"`
	Timeouts    TimeoutsInput     `json:"timeouts"`
	Versions    VersionsInput     `json:"versions"`
	// Grader is osmo's: the grader spec ("" for the workflow's own, or the
	// rollout server's).
	Grader string `json:"grader,omitempty"`
}

// DatasetInput pins the dataset's bytes and the rows selected from it.
type DatasetInput struct {
	SHA256 string `json:"sha256"`
	// SelectedSourceRows is the selection as file offsets ("0-9,12").
	SelectedSourceRows string `json:"selected_source_rows"`
}

// RolloutInput pins the rollout's code.
type RolloutInput struct {
	Name       string `json:"name"`
	Entrypoint string `json:"entrypoint"`
	// SourceDigest is the SHA-256 of the workspace rollout's directory, or
	// of the osmo executable (a workflow of this binary, an exec agent).
	SourceDigest string `json:"source_digest"`
}

type TimeoutsInput struct {
	AgentTimeoutSec  *float64 `json:"agent_timeout_sec"`
	GraderTimeoutSec *float64 `json:"grader_timeout_sec"`
}

type VersionsInput struct {
	RolloutProtocol      string `json:"rollout_protocol"`
	DatasetNormalization int    `json:"dataset_normalization"`
	StateSchema          int    `json:"state_schema"`
}

// Versions is what this build writes.
func Versions() VersionsInput {
	return VersionsInput{RolloutProtocol: RolloutProtocolVersion, DatasetNormalization: DatasetNormalizationVersion, StateSchema: StateSchemaVersion}
}

// Manifest is manifest.json, written once when the run is created.
type Manifest struct {
	SchemaVersion int            `json:"schema_version"`
	LocalRunID    string         `json:"local_run_id"`
	RunName       string         `json:"run_name"`
	CreatedAt     string         `json:"created_at"`
	Inputs        Inputs         `json:"inputs"`
	Provenance    map[string]any `json:"provenance"`
}

// Digest is the SHA-256 of the inputs' canonical JSON: an unnamed run's
// name ends with its first 8 hex digits.
func (in Inputs) Digest() string {
	b, _ := json.Marshal(in) // struct fields in order, map keys sorted
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// ChangedKeys lists the top-level input keys that differ between two
// runs, added or removed keys included.
func ChangedKeys(old, cur Inputs) []string {
	a, b := asTree(old), asTree(cur)
	var keys []string
	for k := range a {
		if !reflect.DeepEqual(a[k], b[k]) {
			keys = append(keys, k)
		}
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys
}

func asTree(in Inputs) map[string]any {
	b, _ := json.Marshal(in)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	return m
}

// FormatRows renders file offsets as a compact selector ("0-9,12").
func FormatRows(idx []int) string {
	s := slices.Clone(idx)
	slices.Sort(s)
	s = slices.Compact(s)
	var parts []string
	for i := 0; i < len(s); {
		j := i
		for j+1 < len(s) && s[j+1] == s[j]+1 {
			j++
		}
		if i == j {
			parts = append(parts, strconv.Itoa(s[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", s[i], s[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

// FileSHA256 is the hex SHA-256 of a file's bytes.
func FileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// What a rollout's source digest leaves out, as the SDK's: environments
// and caches.
var (
	digestSkipDirs     = []string{"__pycache__", ".git", ".venv", "venv", "dist", "build", "node_modules", ".pytest_cache", ".ruff_cache"}
	digestSkipPatterns = []string{"uv.lock", "*.egg-info"}
)

// SourceDigest is the SHA-256 of a rollout directory's files' relative
// paths and bytes, in path order, skipping environments, caches and
// anything under exclude (a run directory inside it). A symlink to a
// directory is refused: the digest could not describe it.
func SourceDigest(root, exclude string) (string, error) {
	var files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if path == root {
			return nil
		}
		name := d.Name()
		skip := slices.Contains(digestSkipDirs, name) && d.IsDir()
		for _, p := range digestSkipPatterns {
			if ok, _ := filepath.Match(p, name); ok {
				skip = true
			}
		}
		if skip || (exclude != "" && (path == exclude || strings.HasPrefix(path, exclude+string(filepath.Separator)))) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.Type()&fs.ModeSymlink != 0 {
			fi, err := os.Stat(path)
			if err != nil || fi.IsDir() {
				return fmt.Errorf("rollout source contains a directory or broken symlink: %s; replace it with a real directory or file so the digest can describe it", path)
			}
		}
		if !d.IsDir() {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	slices.Sort(files)
	h := sha256.New()
	for _, f := range files {
		rel, _ := filepath.Rel(root, f)
		h.Write([]byte(filepath.ToSlash(rel)))
		b, err := os.ReadFile(f)
		if err != nil {
			return "", err
		}
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// ValidRunName reports why name cannot name a run, or nil: one safe path
// segment of letters, digits, '.', '_' and '-', starting with a letter or
// digit, at most 96 characters.
func ValidRunName(name string) error {
	switch {
	case name == "":
		return errors.New("run name must not be empty")
	case len(name) > maxRunName:
		return fmt.Errorf("run name must be at most %d characters: %q", maxRunName, name)
	case name == locksDir:
		return fmt.Errorf("run name %q is reserved", name)
	case name[0] == '-' || name[0] == '.':
		return fmt.Errorf("run name must start with a letter or digit: %q", name)
	}
	if strings.ContainsFunc(name, func(r rune) bool { return !runNameChar(r) }) {
		return fmt.Errorf("run name must use only letters, digits, '.', '_' or '-': %q", name)
	}
	return nil
}

func runNameChar(r rune) bool {
	return r == '.' || r == '_' || r == '-' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9'
}

// runStamp is the SDK's timestamp in run and archive names.
const runStamp = "20060102T150405Z"

// generatedName is an unnamed run's name: STEM-TIME-DIGEST8.
func generatedName(stem, digest string, now time.Time) string {
	safe := strings.Map(func(r rune) rune {
		if runNameChar(r) {
			return r
		}
		return '-'
	}, stem)
	safe = strings.Trim(safe, "-._")
	if safe == "" {
		safe = "eval"
	}
	if len(safe) > maxRunName-len(runStamp)-10 {
		safe = safe[:maxRunName-len(runStamp)-10]
	}
	return safe + "-" + now.UTC().Format(runStamp) + "-" + digest[:8]
}

// latestUnnamed finds the newest run an unnamed invocation of the same
// config and inputs left under root, so the same command resumes it.
func latestUnnamed(root, stem, digest string) string {
	prefix := generatedName(stem, digest, time.Time{})
	prefix = prefix[:len(prefix)-len(runStamp)-len(digest[:8])-1] // "STEM-"
	entries, err := os.ReadDir(root)
	if err != nil {
		return ""
	}
	best := ""
	for _, e := range entries {
		n := e.Name()
		rest, ok := strings.CutPrefix(n, prefix)
		if !ok || !e.IsDir() || len(rest) != len(runStamp)+9 || !strings.HasSuffix(rest, "-"+digest[:8]) {
			continue
		}
		if _, err := time.Parse(runStamp, rest[:len(runStamp)]); err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(root, n, ManifestFile)); err == nil && n > best {
			best = n
		}
	}
	return best
}

// RunDir is an open run: its directory, held by this process.
type RunDir struct {
	Path, Name string
	Manifest   Manifest
	// Created says the run is new (false: a resume); Archived is where an
	// earlier run under the same name went with --fresh.
	Created  bool
	Archived string
	lock     *os.File
}

// Close releases the run's lock.
func (r *RunDir) Close() error {
	if r.lock == nil {
		return nil
	}
	err := r.lock.Close() // closing drops the flock
	r.lock = nil
	return err
}

// ResumeRefusedError is a named run whose pinned inputs differ from this
// invocation's.
type ResumeRefusedError struct {
	Name    string
	Changed []string
}

func (e *ResumeRefusedError) Error() string {
	return fmt.Sprintf("run %q was created with different inputs, so resuming it would mix versions inside one set of metrics. "+
		"Changed: %s. Restart under the same name with --fresh (the previous results are archived, never deleted), or pick another --name.",
		e.Name, strings.Join(e.Changed, ", "))
}

// RunLockedError is a run another process holds.
type RunLockedError struct{ Lock, Holder string }

func (e *RunLockedError) Error() string {
	h := ""
	if e.Holder != "" {
		h = " (" + e.Holder + ")"
	}
	return fmt.Sprintf("another `osmo eval run`%s already holds %s. Wait for it to finish, or use a different --name.", h, e.Lock)
}

// OpenRunOptions say which run to open and how.
type OpenRunOptions struct {
	// Root is the output root; Name the run's name ("" for the last
	// unnamed run of the config Stem with the same inputs, else a new one).
	Root, Name, Stem string
	Inputs           Inputs
	Provenance       map[string]any
	// Fresh archives an existing run of that name and starts a new one.
	Fresh bool
	Now   time.Time
}

// OpenRun opens (creating, resuming or, with Fresh, archiving and
// recreating) a run directory under its lock, which lives under
// ROOT/.locks so that renaming the directory aside cannot let a second
// process in. A resume whose inputs changed gets a *ResumeRefusedError.
func OpenRun(o OpenRunOptions) (*RunDir, error) {
	if o.Now.IsZero() {
		o.Now = time.Now()
	}
	digest := o.Inputs.Digest()
	name := o.Name
	if name == "" {
		name = latestUnnamed(o.Root, o.Stem, digest)
		if name == "" || o.Fresh {
			name = generatedName(o.Stem, digest, o.Now)
		}
	}
	if err := ValidRunName(name); err != nil {
		return nil, err
	}
	lock, err := lockRun(o.Root, name)
	if err != nil {
		return nil, err
	}
	rd := &RunDir{Path: filepath.Join(o.Root, name), Name: name, lock: lock}
	fail := func(err error) (*RunDir, error) { rd.Close(); return nil, err }
	mpath := filepath.Join(rd.Path, ManifestFile)
	_, statErr := os.Stat(mpath)
	exists := statErr == nil
	if !exists {
		if entries, err := os.ReadDir(rd.Path); err == nil && len(entries) > 0 {
			// Files without a manifest are never mixed in, never deleted.
			if !o.Fresh {
				return fail(fmt.Errorf("%s holds files but no %s, so what it ran is unknown: run with --fresh (it is archived, never deleted) or another --name", rd.Path, ManifestFile))
			}
			exists = true
		}
	}
	if exists && o.Fresh {
		if rd.Archived, err = archive(rd.Path, o.Now); err != nil {
			return fail(err)
		}
		exists = false
	}
	if exists {
		m, err := readManifest(mpath)
		if err != nil {
			return fail(err)
		}
		if changed := ChangedKeys(m.Inputs, o.Inputs); len(changed) > 0 {
			return fail(&ResumeRefusedError{Name: name, Changed: changed})
		}
		rd.Manifest = m
		return rd, nil
	}
	if err := os.MkdirAll(rd.Path, 0o755); err != nil {
		return fail(fmt.Errorf("eval: run directory: %w", err))
	}
	rd.Created = true
	rd.Manifest = Manifest{
		SchemaVersion: StateSchemaVersion,
		LocalRunID:    randomHex(16),
		RunName:       name,
		CreatedAt:     sdkTime(o.Now),
		Inputs:        o.Inputs,
		Provenance:    o.Provenance,
	}
	b, err := marshalFile(rd.Manifest)
	if err != nil {
		return fail(err)
	}
	if err := WriteFileAtomic(mpath, b); err != nil {
		return fail(err)
	}
	return rd, nil
}

func readManifest(path string) (Manifest, error) {
	var m Manifest
	b, err := os.ReadFile(path)
	if err != nil {
		return m, fmt.Errorf("eval: %s is unreadable: %w", path, err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("eval: %s is not a manifest: %w", path, err)
	}
	if m.SchemaVersion != StateSchemaVersion {
		return m, fmt.Errorf("eval: %s was written by state schema version %d; this osmo writes version %d. Start a new run with --fresh", path, m.SchemaVersion, StateSchemaVersion)
	}
	return m, nil
}

// archive renames a run directory aside: NAME.archive-TIME[-N].
func archive(dir string, now time.Time) (string, error) {
	base := dir + ".archive-" + now.UTC().Format(runStamp)
	dst := base
	for i := 1; ; i++ {
		if _, err := os.Lstat(dst); errors.Is(err, os.ErrNotExist) {
			break
		}
		dst = fmt.Sprintf("%s-%d", base, i)
	}
	if err := os.Rename(dir, dst); err != nil {
		return "", fmt.Errorf("eval: --fresh: archiving %s: %w", dir, err)
	}
	return dst, nil
}

// lockRun takes ROOT/.locks/NAME.lock without waiting, and writes who
// holds it there for the next one to name.
func lockRun(root, name string) (*os.File, error) {
	dir := filepath.Join(root, locksDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("eval: lock: %w", err)
	}
	path := filepath.Join(dir, name+".lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("eval: lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := io.ReadAll(io.LimitReader(f, 512))
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, &RunLockedError{Lock: path, Holder: strings.TrimSpace(string(holder))}
		}
		return nil, fmt.Errorf("eval: lock %s: %w", path, err)
	}
	host, _ := os.Hostname()
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(fmt.Sprintf("pid %d on %s since %s\n", os.Getpid(), host, time.Now().UTC().Format(time.RFC3339))), 0)
	return f, nil
}
