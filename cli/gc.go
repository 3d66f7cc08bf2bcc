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
// load, and each cycle shows up as a latency spike in calls that happen to
// overlap it: measured with `osmo bench` on 2 CPUs, the proxy's added p99
// over a direct call was +430 µs at GOGC=100 and +180..220 µs at 400, with
// the throughput of tracing-on versus tracing-off moving from 85-96% to
// 93-97%. The price is memory: the heap may grow to five times what is live
// instead of twice. Containers should therefore set GOMEMLIMIT (the
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
