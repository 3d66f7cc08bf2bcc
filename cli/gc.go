package cli

import (
	"runtime/debug"
)

// DefaultGCPercent is the garbage collector's GOGC for osmo processes whose
// environment sets none: Go's own default. It is named so that `osmo
// bench` can state what its processes run at.
//
// A higher GOGC buys CPU with memory: the heap may grow to (1+GOGC/100)
// times what is live. `osmo bench rollouts --baseline` comparing one build
// at GOGC=400 and at 100 (docs/deploy.md, "Memory and the garbage
// collector") found 400 faster only where it also held more memory, and no
// better off where GOMEMLIMIT made both hold the same; so osmo keeps Go's
// default, and containers set GOMEMLIMIT (the Kubernetes manifests set it
// to the container's memory limit) as the ceiling under which the
// collector works harder instead of growing the heap.
const DefaultGCPercent = 100

// applyGCDefault sets DefaultGCPercent unless the environment chose GOGC
// itself (the runtime has already applied it then, "off" included). It is
// called by Main only: it changes the whole process, which a library
// embedding Run, or a test, must decide on for itself.
func applyGCDefault(getenv func(string) string) {
	if getenv("GOGC") != "" {
		return
	}
	debug.SetGCPercent(DefaultGCPercent)
}
