package cli

import (
	"os/exec"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
)

func TestApplyGCDefault(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))

	applyGCDefault(func(string) string { return "" })
	if got := debug.SetGCPercent(100); got != DefaultGCPercent {
		t.Errorf("without GOGC the collector runs at %d, want DefaultGCPercent %d", got, DefaultGCPercent)
	}

	// A GOGC in the environment was applied by the runtime; it stands.
	debug.SetGCPercent(50)
	applyGCDefault(func(k string) string {
		if k == "GOGC" {
			return "50"
		}
		return ""
	})
	if got := debug.SetGCPercent(100); got != 50 {
		t.Errorf("with GOGC=50 set the collector runs at %d, want 50 left alone", got)
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
