//go:build linux

package cli_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/osmo-rl/osmo/cli"
	"github.com/osmo-rl/osmo/internal/proxybench"
	"github.com/osmo-rl/osmo/internal/rolloutbench"
)

// assertReaped fails the test if any of pids is still a process.
func assertReaped(t *testing.T, pids ...int) {
	t.Helper()
	for _, pid := range pids {
		if pid <= 0 {
			continue
		}
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("proxy process %d is still there after the measurement (kill 0: %v)", pid, err)
		}
	}
}

func affinity(t *testing.T) unix.CPUSet {
	t.Helper()
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	return set
}

// TestMeasureOneCore runs the one-core measurement against real `osmo
// llmproxy` processes (this test binary) and checks what it reports.
func TestMeasureOneCore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// An OTLP endpoint in the environment must not reach the untraced
	// proxy: anything it exported would arrive here.
	var leaked atomic.Int64
	leak := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaked.Add(1)
	}))
	defer leak.Close()
	env := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + leak.URL, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf", "GOMAXPROCS=2"}

	before := affinity(t)
	const requests = 400
	rep, err := proxybench.MeasureOneCore(ctx, proxybench.OneCoreConfig{
		Command: func(args []string) *exec.Cmd { return osmoCommand(env, append([]string{"llmproxy"}, args...)...) },
		ReverseProxyCommand: func(args []string) *exec.Cmd {
			return osmoCommand(env, append([]string{"bench", "reverse-proxy"}, args...)...)
		},
		Requests: requests, Rounds: 4, Clients: 4,
	})
	if err != nil {
		t.Fatalf("MeasureOneCore: %v", err)
	}
	assertReaped(t, rep.Off.PID, rep.Tracing.PID, rep.ReverseProxy.PID)
	if after := affinity(t); after != before {
		t.Errorf("this process's CPU affinity is %v after the measurement, want %v restored", after, before)
	}
	if rep.Skipped != "" {
		t.Fatalf("skipped: %s", rep.Skipped)
	}
	for _, s := range []proxybench.OneCoreSetup{rep.Off, rep.Tracing, rep.ReverseProxy} {
		if s.Requests != requests || s.Warmup <= 0 || s.Wall <= 0 || s.PID <= 0 {
			t.Errorf("%s: %+v, want %d timed requests, a warm-up, a wall time and a pid", s.Name, s, requests)
		}
		if s.Latency.P50 <= 0 || s.Latency.P99 < s.Latency.P50 {
			t.Errorf("%s: latency %+v, want a positive p50 and a p99 at least as long", s.Name, s.Latency)
		}
		if s.CPUPerRequest() <= 0 || s.Capacity() <= 0 || s.Throughput() <= 0 {
			t.Errorf("%s: CPU per request %.1fµs, capacity %.0f, throughput %.0f: want all positive", s.Name, s.CPUPerRequest(), s.Capacity(), s.Throughput())
		}
	}
	if d := rep.Direct; d.Name != "direct" || d.Requests != requests || d.PID != 0 || d.Latency.P50 <= 0 || d.Latency.P99 < d.Latency.P50 {
		t.Errorf("direct: %+v, want %d timed requests with their latency and no process", d, requests)
	}
	pids := map[int]bool{}
	for _, s := range []proxybench.OneCoreSetup{rep.Off, rep.Tracing, rep.ReverseProxy} {
		pids[s.PID] = true
	}
	if len(pids) != 3 {
		t.Errorf("setups shared a process: %d %d %d", rep.Off.PID, rep.Tracing.PID, rep.ReverseProxy.PID)
	}
	// The reverse proxy records nothing and exports nothing.
	if rep.ReverseProxy.Spans != 0 {
		t.Errorf("the reverse proxy exported %d spans", rep.ReverseProxy.Spans)
	}
	if rep.ReverseProxyThroughputRatio() <= 0 || rep.ReverseProxyCPURatio() <= 0 {
		t.Errorf("ratios to the reverse proxy: req/s %v, CPU %v, want positive", rep.ReverseProxyThroughputRatio(), rep.ReverseProxyCPURatio())
	}
	// Every call is a span, flushed when the proxy stops.
	if s := rep.Tracing; s.Spans < int64(s.Requests+s.Warmup) {
		t.Errorf("the sink received %d spans from the %s proxy, want at least one per call (%d)", s.Spans, s.Name, s.Requests+s.Warmup)
	}
	if rep.Off.Spans != 0 || leaked.Load() != 0 {
		t.Errorf("the untraced proxy exported: %d spans to the sink, %d requests to the environment's endpoint", rep.Off.Spans, leaked.Load())
	}
	if rep.TracingCPURatio() <= 0 || rep.TracingThroughputRatio() <= 0 {
		t.Errorf("tracing ratios %v %v, want positive", rep.TracingCPURatio(), rep.TracingThroughputRatio())
	}
	if len(rep.Warnings) > 0 {
		t.Errorf("warnings: %q", rep.Warnings)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	for _, s := range []string{"proxy process on one core", "off", "tracing", "reverseproxy", "direct", "p99", "CPU/req", "capacity on one core", "tracing/off", "off against reverseproxy: added p99"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, out.String())
		}
	}
}

// TestMeasureOneCoreCancel stops the proxy processes when the context ends
// mid-measurement.
func TestMeasureOneCoreCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(time.Second, cancel)
	start := time.Now()
	rep, err := proxybench.MeasureOneCore(ctx, proxybench.OneCoreConfig{
		Command:  func(args []string) *exec.Cmd { return osmoCommand(nil, append([]string{"llmproxy"}, args...)...) },
		Requests: 1 << 30, Rounds: 2, Clients: 2,
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("MeasureOneCore with a canceled context: %v (skipped: %q), want context.Canceled", err, rep.Skipped)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("returned %s after the start, long after the cancellation", d)
	}
	assertReaped(t, rep.Off.PID, rep.Tracing.PID)
}

// TestBench runs `osmo bench` whole, the one-core section and the servers
// of the rollout figures with this test binary as osmo; the cluster row
// too when a nats-server is to be had.
func TestBench(t *testing.T) {
	t.Setenv(osmoModeEnv, "1")
	t.Setenv("GORACE", childGORACE())
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	// Found (or built) once here, for the bench to use as it is.
	nats, natsErr := rolloutbench.FindNATS(ctx, os.Getenv("OSMO_NATS_BIN"))
	if natsErr == nil {
		t.Setenv("OSMO_NATS_BIN", nats)
	}
	var out, errOut bytes.Buffer
	// Small enough for race-enabled servers: the figures are not judged
	// here, only that every section runs.
	args := []string{"bench", "-n", "100", "--rollouts", "100", "--concurrency", "8", "--in-flight", "100"}
	if err := cli.Run(ctx, args, &out, &errOut); err != nil {
		t.Fatalf("osmo bench: %v\n%s", err, errOut.String())
	}
	t.Log("\n" + out.String())
	// The proxies run at osmo's default GOGC unless the environment sets one.
	gogc := os.Getenv("GOGC")
	if gogc == "" {
		gogc = strconv.Itoa(cli.DefaultGCPercent)
	}
	for _, s := range []string{"llmproxy - direct", "proxy process on one core", "capacity on one core", "proxy GOGC=" + gogc,
		"llmproxy against reverseproxy", "Rollouts end to end", "state writes", "state bytes", "100 in flight", "all graded when released: true"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("osmo bench output lacks %q:\n%s", s, out.String())
		}
	}
	if strings.Contains(out.String(), "proxy process on one core: skipped") {
		t.Errorf("osmo bench skipped the one-core section:\n%s", out.String())
	}
	checkRolloutRow(t, out.String(), rolloutbench.RowEmbedded, 100, true)
	checkPeakRSS(t, out.String())
	if natsErr != nil {
		t.Logf("no nats-server (%v): the cluster row is not checked", natsErr)
		if !strings.Contains(out.String(), "cluster: skipped: ") {
			t.Errorf("osmo bench output says neither the cluster's figures nor why they were skipped:\n%s", out.String())
		}
		return
	}
	checkRolloutRow(t, out.String(), rolloutbench.RowCluster, 100, false)
}

// checkRolloutRow finds the row name of the rollout table in out and
// checks that its rollouts/s and state figures are positive and that all
// n of its rollouts were graded; with cost, that its CPU and allocations
// per rollout are positive, else that they read n/a.
func checkRolloutRow(t *testing.T, out, name string, n int, cost bool) {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		rest, ok := strings.CutPrefix(line, "  "+name)
		if !ok {
			continue
		}
		// rollouts/s, p50 "ms", p99 "ms", graded, writes, bytes "KiB",
		// then CPU "µs", alloc "KiB", allocs; or n/a, n/a, n/a.
		f := strings.Fields(rest)
		want := []string{"", "", "ms", "", "ms", "", "", "", "KiB", "", "µs", "", "KiB", ""}
		if !cost {
			want = append(want[:9], "n/a", "n/a", "n/a")
		}
		if len(f) != len(want) {
			t.Fatalf("row %q: %d fields, want %d: %q", name, len(f), len(want), line)
		}
		for i, w := range want {
			switch {
			case w != "":
				if f[i] != w {
					t.Errorf("row %q: field %d is %q, want %q: %q", name, i, f[i], w, line)
				}
			case i == 5:
				if want := fmt.Sprintf("%d/%d", n, n); f[i] != want {
					t.Errorf("row %q: graded %s, want %s: %q", name, f[i], want, line)
				}
			default:
				checkPositive(t, fmt.Sprintf("row %q: field %d", name, i), f[i])
			}
		}
		return
	}
	t.Errorf("osmo bench output has no row %q:\n%s", name, out)
}

// checkPositive fails the test unless s is a positive, finite number.
func checkPositive(t *testing.T, what, s string) {
	t.Helper()
	if v, err := strconv.ParseFloat(s, 64); err != nil || !(v > 0) || math.IsInf(v, 0) {
		t.Errorf("%s is %q, want a positive finite number", what, s)
	}
}

// checkPeakRSS finds the peak RSS of the held rollouts in out: a positive
// number of MiB.
func checkPeakRSS(t *testing.T, out string) {
	t.Helper()
	_, rest, ok := strings.Cut(out, "; peak RSS ")
	f := strings.Fields(rest)
	if !ok || len(f) < 2 || f[1] != "MiB" {
		t.Errorf("osmo bench output has no peak RSS in MiB:\n%s", out)
		return
	}
	checkPositive(t, "peak RSS", f[0])
}

// TestBenchBaseline compares osmo serve with a baseline build (this test
// binary again): one round of each, every rollout graded, the ratio line
// printed.
func TestBenchBaseline(t *testing.T) {
	t.Setenv(osmoModeEnv, "1")
	t.Setenv("GORACE", childGORACE())
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	args := []string{"bench", "rollouts", "--baseline", os.Args[0], "--rounds", "2", "--rollouts", "100", "--concurrency", "8", "--in-flight", "50",
		"--server-env", "GOGC=400", "--baseline-env", "GOGC=100"}
	if err := cli.Run(ctx, args, &out, &errOut); err != nil {
		t.Fatalf("osmo bench rollouts --baseline: %v\n%s", err, errOut.String())
	}
	t.Log("\n" + out.String())
	rows := map[string]int{}
	for _, line := range strings.Split(out.String(), "\n") {
		for _, name := range []string{rolloutbench.RowCurrent, rolloutbench.RowBaseline} {
			rest, ok := strings.CutPrefix(line, "  "+name)
			if !ok {
				continue
			}
			// round, rollouts/s, p50 "ms", p99 "ms", graded, CPU "µs",
			// alloc "KiB", allocs, RSS held "MiB", of it anonymous "MiB",
			// peak RSS "MiB"
			f := strings.Fields(rest)
			want := []string{"", "", "", "ms", "", "ms", "100/100", "", "µs", "", "KiB", "", "", "MiB", "", "MiB", "", "MiB"}
			if len(f) != len(want) {
				t.Fatalf("row %q: %d fields, want %d", line, len(f), len(want))
			}
			for i, w := range want {
				if w != "" && f[i] != w {
					t.Errorf("row %q: field %d is %q, want %q", line, i, f[i], w)
				}
			}
			for _, i := range []int{1, 2, 4, 7, 9, 11, 12, 14, 16} {
				checkPositive(t, fmt.Sprintf("row %q: field %d", line, i), f[i])
			}
			rows[name]++
		}
	}
	if rows[rolloutbench.RowCurrent] != 2 || rows[rolloutbench.RowBaseline] != 2 {
		t.Errorf("rows per server: %v, want 2 of each:\n%s", rows, out.String())
	}
	_, ratios, ok := strings.Cut(out.String(), "this osmo serve against the baseline, medians: ")
	ratios, _, _ = strings.Cut(ratios, "\n")
	if !ok {
		t.Errorf("no ratio line:\n%s", out.String())
	}
	// Every figure is compared: each ratio a positive number.
	for _, name := range []string{"rollouts/s", "p50", "p99", "CPU/rollout", "alloc/rollout", "allocs/rollout", "RSS with 50 held", "anonymous RSS with 50 held", "peak RSS"} {
		_, rest, ok := strings.Cut(ratios, name+" ")
		x, _, _ := strings.Cut(rest, ",")
		if v, found := strings.CutSuffix(x, "x"); !ok || !found {
			t.Errorf("ratio line has no %s ratio: %q", name, ratios)
		} else {
			checkPositive(t, name+" ratio", v)
		}
	}
	if strings.Contains(out.String(), "in flight") || strings.Contains(out.String(), "cluster") {
		t.Errorf("a comparison prints only itself:\n%s", out.String())
	}
}

// TestBenchBaselineMissing: a baseline that is not a program is a usage
// error naming the flag, before anything runs.
func TestBenchBaselineMissing(t *testing.T) {
	var out, errOut bytes.Buffer
	err := cli.Run(context.Background(), []string{"bench", "rollouts", "--baseline", filepath.Join(t.TempDir(), "no-such-osmo")}, &out, &errOut)
	if err == nil || !strings.Contains(err.Error()+errOut.String(), "--baseline") {
		t.Fatalf("err %v, stderr %q: want a usage error naming --baseline", err, errOut.String())
	}
}

// TestBenchProxyArgs: osmo bench proxy takes only -n; anything else is a
// usage error before anything runs.
func TestBenchProxyArgs(t *testing.T) {
	for _, args := range [][]string{{"bench", "proxy", "extra"}, {"bench", "proxy", "-n", "5"}, {"bench", "proxy", "--rollouts", "5"}, {"bench", "proxy", "--help"}} {
		var out, errOut bytes.Buffer
		err := cli.Run(t.Context(), args, &out, &errOut)
		if err == nil || out.Len() > 0 {
			t.Errorf("%q: err %v, stdout %q: want a usage error and nothing measured", args, err, out.String())
		}
	}
}
