package cli

import (
	"os"
	"os/exec"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
)

// Without GOGC in the environment the collector runs at DefaultGCPercent.
func TestDefaultGCPercent(t *testing.T) {
	if os.Getenv("GOGC") != "" {
		t.Skip("GOGC is set")
	}
	if got := debug.SetGCPercent(DefaultGCPercent); got != DefaultGCPercent {
		t.Errorf("without GOGC the collector runs at %d, want DefaultGCPercent %d", got, DefaultGCPercent)
	}
}

// TestProgramCommandEnv: the bench's osmo processes run at osmo's default
// GOGC unless told otherwise, and --server-env's variables come last, so
// they win.
func TestProgramCommandEnv(t *testing.T) {
	e := &env{getenv: func(string) string { return "" }}
	gogc := func(cmd *exec.Cmd) string {
		v := ""
		for _, kv := range cmd.Environ() {
			if val, ok := strings.CutPrefix(kv, "GOGC="); ok {
				v = val
			}
		}
		return v
	}
	if got, want := gogc(programCommand(e, "/bin/true", "serve")(nil)), strconv.Itoa(DefaultGCPercent); got != want {
		t.Errorf("GOGC=%q, want osmo's default %s", got, want)
	}
	if got := gogc(programCommand(e, "/bin/true", "serve", "GOGC=100")(nil)); got != "100" {
		t.Errorf("with GOGC=100 asked for: GOGC=%q", got)
	}
}
