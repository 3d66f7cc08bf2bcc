package execagent

import (
	"cmp"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// allowedEnv reports whether a variable of the server's environment is
// passed to the program: what locates its runtime and libraries (PATH,
// HOME, Node's and Python's own variables, virtualenvs, CA bundles) and the
// locale. Everything else, the server's credentials included, is withheld;
// Config.PassEnv names more, and Config.Env sets values.
func allowedEnv(key string) bool {
	switch key {
	case "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
		"NODE_PATH", "NODE_OPTIONS", "NODE_EXTRA_CA_CERTS", "NVM_DIR", "NVM_BIN",
		"PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE",
		"PYTHONUTF8", "VIRTUAL_ENV", "CONDA_PREFIX", "PYENV_ROOT", "PYENV_VERSION",
		"SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE":
		return true
	}
	return strings.HasPrefix(key, "LC_")
}

// passed reports whether the server's variable key reaches the program:
// allowed, or named by pass (an entry ending in * is a prefix), and never
// reserved.
func passed(key string, pass []string) bool {
	return !reservedEnv(key) && (allowedEnv(key) || slices.ContainsFunc(pass, func(p string) bool {
		prefix, ok := strings.CutSuffix(p, "*")
		return ok && strings.HasPrefix(key, prefix) || p == key
	}))
}

// scratchDirs makes the runs' scratch directories: under base (os.TempDir()
// when empty), each its run's working directory and TMPDIR (and HOME when
// it runs as another user), private to it (0700), removed when the run
// ends. Two runs of a coding agent then never write into each other's
// files. Their names carry the server's pid, so that the first run under
// a base removes the directories a server killed before it could left
// there, and never those of a live server sharing the base.
type scratchDirs struct {
	swept sync.Map // bases swept: string → struct{}
}

const scratchPrefix = "osmo-exec-"

func (d *scratchDirs) make(base string, runAs *RunAs, log *slog.Logger) (string, error) {
	if _, done := d.swept.LoadOrStore(base, struct{}{}); !done {
		sweepScratch(cmp.Or(base, os.TempDir()), log)
	}
	dir, err := os.MkdirTemp(base, fmt.Sprintf("%s%d-", scratchPrefix, os.Getpid()))
	if err != nil {
		return "", fmt.Errorf("scratch directory: %w", err)
	}
	if runAs != nil {
		if err := os.Chown(dir, int(runAs.UID), int(runAs.GID)); err != nil {
			_ = os.Remove(dir)
			return "", fmt.Errorf("scratch directory: %w", err)
		}
	}
	return dir, nil
}

// sweepScratch removes the scratch directories under base whose server
// is gone.
func sweepScratch(base string, log *slog.Logger) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), scratchPrefix)
		pidText, _, hasPid := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if !ok || !hasPid || err != nil || !e.IsDir() || pid == os.Getpid() || !processGone(pid) {
			continue
		}
		dir := filepath.Join(base, e.Name())
		if err := removeAll(dir); err != nil {
			log.Warn("exec: could not remove a scratch directory a stopped server left", "dir", dir, "error", err)
			continue
		}
		log.Info("exec: removed a scratch directory a stopped server left", "dir", dir)
	}
}

// removeAll removes dir and everything in it. A directory the program took
// its own permissions from (chmod 0) stops os.RemoveAll for a server that is
// not root; it is opened up, and the removal tried again.
func removeAll(dir string) error {
	if os.RemoveAll(dir) == nil {
		return nil
	}
	// WalkDir calls back before it reads a directory, so each is opened up
	// before it is read.
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			_ = os.Chmod(path, 0o700)
		}
		return nil
	})
	return os.RemoveAll(dir)
}

// LimitError is a run that hit one of its Limits: the kernel refused it
// memory, a process, CPU time or file size, and the run was ended.
type LimitError struct {
	// Limit is the key of the limit (memory, processes, cpu, file-size).
	Limit string
	// Value is the limit, as the text form writes it (512MiB).
	Value string
	// How says what the kernel did (the OOM killer killed a process).
	How string
	// StderrTail is the end of the program's stderr.
	StderrTail string
}

func (e *LimitError) Error() string {
	what := map[string]string{
		"memory":    "memory limit",
		"processes": "process limit",
		"cpu":       "CPU time limit",
		"file-size": "file size limit",
	}[e.Limit]
	what = cmp.Or(what, e.Limit+" limit")
	msg := fmt.Sprintf("exec agent exceeded its %s (%s=%s)", what, e.Limit, e.Value)
	if e.How != "" {
		msg += ": " + e.How
	}
	return withStderr(msg, e.StderrTail)
}

// signalLimit names the limit behind a program's death by signal: SIGXCPU,
// or SIGKILL once its CPU time passed the limit (RLIMIT_CPU's hard limit),
// and SIGXFSZ.
func signalLimit(lim Limits, signal string, cpu time.Duration) *LimitError {
	switch {
	case signal == "SIGXCPU", signal == "SIGKILL" && lim.CPU > 0 && cpu >= lim.CPU:
		return &LimitError{Limit: "cpu", Value: lim.value("cpu"), How: "killed by " + signal + " after " + cpu.Round(time.Millisecond).String() + " of CPU time"}
	case signal == "SIGXFSZ":
		return &LimitError{Limit: "file-size", Value: lim.value("file-size"), How: "killed by SIGXFSZ"}
	}
	return nil
}

// scratchEnv points the program's temporary files, and its home when it
// runs as another user (the server's home is not its own), at its scratch
// directory.
func scratchEnv(dir string, ownHome bool) []string {
	env := []string{"TMPDIR=" + dir, "TMP=" + dir, "TEMP=" + dir}
	if ownHome {
		env = append(env, "HOME="+dir)
	}
	return env
}
