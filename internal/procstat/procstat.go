// Package procstat reads what Linux's /proc says a process has cost so
// far: its CPU time (/proc/PID/stat) and its resident memory, now and at
// its peak (/proc/PID/status). Elsewhere every reading fails with
// ErrUnsupported.
package procstat

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// ErrUnsupported is the error of every reading on a system without Linux's
// /proc.
var ErrUnsupported = errors.New("procstat: needs Linux's /proc")

// clockTicks is the unit of utime and stime in /proc/PID/stat. Those fields
// are in USER_HZ, which the kernel fixes at 100 on every Linux architecture
// whatever its internal tick rate (sysconf(_SC_CLK_TCK) returns it, and
// golang.org/x/sys/unix has no sysconf).
const clockTicks = 100

// CPU is the CPU time (user and system, all threads) process pid has used
// so far, to 1/100 of a second.
func CPU(pid int) (time.Duration, error) {
	b, err := read(pid, "stat")
	if err != nil {
		return 0, err
	}
	d, err := parseStat(b)
	if err != nil {
		return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return d, nil
}

// Memory is a process's resident set, in bytes.
type Memory struct {
	// RSS is resident now (VmRSS); Peak the most that has ever been
	// (VmHWM, the high-water mark).
	RSS, Peak uint64
	// Anon is the part of RSS that is the process's own memory (RssAnon),
	// 0 where the kernel does not say (before Linux 4.5). The rest is
	// mostly the executable's pages, which count as resident once
	// mapped: how many are mapped depends on how the file sits in the
	// page cache (the same binary, copied afresh, maps fewer), not on
	// anything the process does.
	Anon uint64
}

// Mem reads process pid's resident memory.
func Mem(pid int) (Memory, error) {
	b, err := read(pid, "status")
	if err != nil {
		return Memory{}, err
	}
	m, err := parseStatus(b)
	if err != nil {
		return Memory{}, fmt.Errorf("/proc/%d/status: %w", pid, err)
	}
	return m, nil
}

func read(pid int, file string) ([]byte, error) {
	if runtime.GOOS != "linux" {
		return nil, ErrUnsupported
	}
	return os.ReadFile("/proc/" + strconv.Itoa(pid) + "/" + file)
}

// parseStat is utime+stime of a /proc/PID/stat.
func parseStat(b []byte) (time.Duration, error) {
	// Field 2, the command name, is in parentheses and may hold spaces
	// and parentheses: the last ')' ends it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("no command name")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): utime and stime, fields 14 and 15, are
	// f[11] and f[12].
	if len(f) < 13 {
		return 0, fmt.Errorf("%d fields, want at least 15", len(f)+2)
	}
	utime, err1 := strconv.ParseUint(f[11], 10, 63)
	stime, err2 := strconv.ParseUint(f[12], 10, 63)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
}

// parseStatus is VmRSS, VmHWM and RssAnon of a /proc/PID/status
// ("VmRSS:	  1234 kB").
func parseStatus(b []byte) (Memory, error) {
	var m Memory
	var rss, hwm bool
	for line := range strings.Lines(string(b)) {
		name, value, ok := strings.Cut(line, ":")
		if !ok || (name != "VmRSS" && name != "VmHWM" && name != "RssAnon") {
			continue
		}
		kb, ok := strings.CutSuffix(strings.TrimSpace(value), " kB")
		if !ok {
			return Memory{}, fmt.Errorf("%s: %q is not in kB", name, strings.TrimSpace(value))
		}
		n, err := strconv.ParseUint(strings.TrimSpace(kb), 10, 54)
		if err != nil {
			return Memory{}, fmt.Errorf("%s: %w", name, err)
		}
		switch name {
		case "VmRSS":
			m.RSS, rss = n<<10, true
		case "VmHWM":
			m.Peak, hwm = n<<10, true
		default:
			m.Anon = n << 10
		}
	}
	if !rss || !hwm {
		return Memory{}, errors.New("no VmRSS or VmHWM (a kernel thread, or a process that has exited)")
	}
	return m, nil
}
