package cli

import (
	"runtime/debug"
)

// DefaultGCPercent is the garbage collector's GOGC for osmo processes whose
// environment sets none (Go's own default is 100).
//
// The services keep little memory alive (a proxy holds a few calls; a
// rollout replica its running conversations and recent records) but
// allocate with every request, mostly inside net/http. At GOGC=100 such a
// process collects every few megabytes, several times per second under
// load, and each cycle costs CPU and shows up as a latency spike in calls
// that happen to overlap it. Measured with `osmo bench -n 5000` on 2 CPUs
// (three runs each, docs/deploy.md), the proxy's added p99 over a direct
// call in one process was +468..631 µs at GOGC=100 and +79..85 µs at 400,
// and the standalone proxy alone on one core spent 48.5-50 µs of CPU per
// call at GOGC=100 and 45.5-47.5 µs at 400 (60.5-63.5 and 51.5-53 µs with
// every call's span exported over OTLP). The price is memory: the heap may
// grow to five times what is live instead of twice. Containers should therefore set GOMEMLIMIT (the
// Kubernetes manifests set it to the container's memory limit), under which
// the collector works harder instead of letting the heap grow past it.
const DefaultGCPercent = 400

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
