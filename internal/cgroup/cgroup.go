// Package cgroup gives each exec agent run a control group of its own: a
// memory and process-count limit the kernel enforces on the whole process
// tree, a way to kill every process in it (those that left their process
// group too), and counters that say whether a limit was hit. Groups are
// created under osmo's own group (/proc/self/cgroup), so a container or a
// systemd unit that delegates its subtree is enough.
//
// It writes a handful of cgroupfs files, on cgroup v2 or, where the memory
// and pids controllers are still there, v1: two limits and two counters
// fit in one file a reader can check against the kernel's documentation,
// where a general library such as containerd/cgroups brings every
// controller and its dependencies. On v2 a process starts inside its group
// (Group.FD, clone3's CLONE_INTO_CGROUP); v1 has no such start, so there a
// process is moved in (Group.Add) while its caller holds it stopped.
package cgroup

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Limits are the kernel-enforced limits of a Group. Zero means no limit.
type Limits struct {
	// Memory is the most memory, in bytes, the group's processes may use
	// together (swap included where the kernel accounts it); past it the
	// kernel's OOM killer kills one of them.
	Memory int64
	// Processes is the most processes and threads the group may hold; a
	// fork past it fails with EAGAIN.
	Processes int
}

// Events counts what the kernel refused the group.
type Events struct {
	// OOMKills is how many of its processes the OOM killer killed.
	OOMKills int
	// ForkFailures is how many forks failed at the process limit.
	ForkFailures int
}

// ErrUnavailable wraps every reason Detect finds no usable hierarchy.
var ErrUnavailable = errors.New("no writable cgroup hierarchy")

// readKeyed reads the value of key from a "key value" per line file such as
// memory.events or pids.events; a missing key is 0.
func readKeyed(data, key string) int {
	for line := range strings.Lines(data) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), " ")
		if ok && k == key {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

func unavailable(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUnavailable, fmt.Sprintf(format, args...))
}
