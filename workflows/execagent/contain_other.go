//go:build !linux

package execagent

import (
	"log/slog"
	"os/exec"
	"sync"
)

// host offers nothing off Linux: no cgroups, and rlimits for a child need
// prlimit, which is Linux's.
type host struct {
	logged  sync.Once
	scratch scratchDirs
}

func (h *host) logOnce(log *slog.Logger, asked Limits) {
	h.logged.Do(func() { log.Warn("exec agents not contained", h.enforcement(asked)...) })
}

func detectHost() *host { return &host{} }

func (h *host) enforcement(asked Limits) []any {
	return []any{"limits", asked.effective().String(), "where", "not enforced on this system: only Linux contains exec agents"}
}

// jail is only the scratch directory (working directory and TMPDIR) here.
type jail struct {
	lim     Limits
	scratch string
}

func (h *host) newJail(asked Limits, scratchBase string, log *slog.Logger) (*jail, error) {
	j := &jail{lim: asked.effective()}
	var err error
	j.scratch, err = h.scratch.make(scratchBase, j.lim.User, log)
	return j, err
}

func (j *jail) start(newCmd func() *exec.Cmd) (*exec.Cmd, error) {
	cmd := newCmd()
	return cmd, cmd.Start()
}

func (j *jail) check() *LimitError                     { return nil }
func (j *jail) watch(exited <-chan struct{}, _ func()) {}
func (j *jail) killAll()                               {}
func (j *jail) close()                                 { _ = removeAll(j.scratch) }
