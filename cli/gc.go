package cli

import (
	"runtime/debug"
)

// DefaultGCPercent is the garbage collector's GOGC for osmo processes whose
// environment sets none: Go's own default, named so that `osmo bench` can
// state what its processes run at. A higher GOGC was faster only where it
// also held more memory (docs/deploy.md, "Memory and the garbage
// collector"): containers set GOMEMLIMIT as the ceiling instead.
const DefaultGCPercent = 100

// applyGCDefault sets DefaultGCPercent unless the environment chose GOGC
// (the runtime has applied it then). Only Main calls it: it changes the
// whole process, which a library embedding Run, or a test, decides on.
func applyGCDefault(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(DefaultGCPercent)
	}
}
