package procstat

import (
	"errors"
	"os"
	"runtime"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	for _, tc := range []struct {
		name, stat string
		want       time.Duration
		bad        bool
	}{
		// Fields 14 and 15 (utime, stime) are 1234 and 56 ticks.
		{name: "plain", stat: "4242 (osmo) S 1 4242 4242 0 -1 4194560 12345 0 0 0 1234 56 0 0 20 0 9 0 100 2000000 3000 18446744073709551615\n", want: 12900 * time.Millisecond},
		{name: "command with spaces and parentheses", stat: "7 (my (odd) cmd) R 1 7 7 0 -1 0 0 0 0 0 3 4 0 0 20 0 1 0 1 1 1", want: 70 * time.Millisecond},
		{name: "no command", stat: "7 osmo R 1", bad: true},
		{name: "too few fields", stat: "7 (osmo) R 1 7 7 0 -1 0 0 0 0 0 3", bad: true},
		{name: "not a number", stat: "7 (osmo) R 1 7 7 0 -1 0 0 0 0 0 x 4 0", bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStat([]byte(tc.stat))
			if tc.bad {
				if err == nil {
					t.Errorf("parseStat = %v, want an error", got)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("parseStat = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func TestParseStatus(t *testing.T) {
	const status = "Name:\tosmo\nUmask:\t0022\nState:\tS (sleeping)\nVmPeak:\t 2000000 kB\nVmSize:\t 1900000 kB\nVmHWM:\t  950000 kB\nVmRSS:\t  120000 kB\nRssAnon:\t   80000 kB\nRssFile:\t   40000 kB\nThreads:\t9\n"
	got, err := parseStatus([]byte(status))
	if want := (Memory{RSS: 120000 << 10, Peak: 950000 << 10, Anon: 80000 << 10}); err != nil || got != want {
		t.Errorf("parseStatus = %+v, %v; want %+v", got, err, want)
	}
	// Before Linux 4.5 there is no RssAnon.
	got, err = parseStatus([]byte("VmHWM:\t 20 kB\nVmRSS:\t 10 kB\n"))
	if want := (Memory{RSS: 10 << 10, Peak: 20 << 10}); err != nil || got != want {
		t.Errorf("parseStatus without RssAnon = %+v, %v; want %+v", got, err, want)
	}
	for _, bad := range []string{
		"Name:\tkthreadd\nState:\tS (sleeping)\n", // a kernel thread has neither
		"VmHWM:\t 10 kB\n",                        // no VmRSS
		"VmHWM:\t 10 kB\nVmRSS:\t 10 MB\n",        // not kB
		"VmHWM:\t 10 kB\nVmRSS:\t ten kB\n",       // not a number
	} {
		if m, err := parseStatus([]byte(bad)); err == nil {
			t.Errorf("parseStatus(%q) = %+v, want an error", bad, m)
		}
	}
}

// TestSelf reads this process: some CPU spent, a resident set no larger
// than its peak.
func TestSelf(t *testing.T) {
	cpu, cpuErr := CPU(os.Getpid())
	m, memErr := Mem(os.Getpid())
	if runtime.GOOS != "linux" {
		if !errors.Is(cpuErr, ErrUnsupported) || !errors.Is(memErr, ErrUnsupported) {
			t.Errorf("CPU: %v, Mem: %v; want ErrUnsupported off Linux", cpuErr, memErr)
		}
		return
	}
	for start := time.Now(); cpu == 0 && time.Since(start) < 5*time.Second; cpu, cpuErr = CPU(os.Getpid()) {
		for i := 0; i < 1e6; i++ {
			_ = i * i
		}
	}
	if cpuErr != nil || cpu <= 0 {
		t.Errorf("CPU = %v, %v; want some", cpu, cpuErr)
	}
	if memErr != nil || m.RSS == 0 || m.Peak < m.RSS || m.Anon == 0 || m.Anon > m.RSS {
		t.Errorf("Mem = %+v, %v; want a resident set at most its peak, part of it anonymous", m, memErr)
	}
}
