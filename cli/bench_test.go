//go:build linux

package cli_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/osmo-rl/osmo/cli"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
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
	rep, err := llmproxy.MeasureOneCore(ctx, llmproxy.OneCoreConfig{
		Command:  func(args []string) *exec.Cmd { return osmoCommand(env, append([]string{"llmproxy"}, args...)...) },
		Requests: requests, Rounds: 4, Clients: 4,
	})
	if err != nil {
		t.Fatalf("MeasureOneCore: %v", err)
	}
	assertReaped(t, rep.Off.PID, rep.Tracing.PID, rep.SDK.PID)
	if after := affinity(t); after != before {
		t.Errorf("this process's CPU affinity is %v after the measurement, want %v restored", after, before)
	}
	if rep.Skipped != "" {
		t.Fatalf("skipped: %s", rep.Skipped)
	}
	for _, s := range []llmproxy.OneCoreSetup{rep.Off, rep.Tracing, rep.SDK} {
		if s.Requests != requests || s.Warmup <= 0 || s.Wall <= 0 || s.PID <= 0 {
			t.Errorf("%s: %+v, want %d timed requests, a warm-up, a wall time and a pid", s.Name, s, requests)
		}
		if s.CPUPerRequest() <= 0 || s.Capacity() <= 0 || s.Throughput() <= 0 {
			t.Errorf("%s: CPU per request %.1fµs, capacity %.0f, throughput %.0f: want all positive", s.Name, s.CPUPerRequest(), s.Capacity(), s.Throughput())
		}
	}
	if rep.Off.PID == rep.Tracing.PID || rep.Tracing.PID == rep.SDK.PID || rep.Off.PID == rep.SDK.PID {
		t.Errorf("setups shared a process: %d %d %d", rep.Off.PID, rep.Tracing.PID, rep.SDK.PID)
	}
	// Every call is a span, flushed when the proxy stops, whichever the
	// pipeline.
	for _, s := range []llmproxy.OneCoreSetup{rep.Tracing, rep.SDK} {
		if calls := int64(s.Requests + s.Warmup); s.Spans < calls {
			t.Errorf("the sink received %d spans from the %s proxy, want at least one per call (%d)", s.Spans, s.Name, calls)
		}
	}
	if rep.Off.Spans != 0 || leaked.Load() != 0 {
		t.Errorf("the untraced proxy exported: %d spans to the sink, %d requests to the environment's endpoint", rep.Off.Spans, leaked.Load())
	}
	if rep.TracingCPURatio() <= 0 || rep.TracingThroughputRatio() <= 0 || rep.SDKCPURatio() <= 0 || rep.SDKThroughputRatio() <= 0 {
		t.Errorf("tracing ratios %v %v, SDK %v %v, want positive", rep.TracingCPURatio(), rep.TracingThroughputRatio(), rep.SDKCPURatio(), rep.SDKThroughputRatio())
	}
	if len(rep.Warnings) > 0 {
		t.Errorf("warnings: %q", rep.Warnings)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	for _, s := range []string{"proxy process on one core", "off", "tracing", "tracing-sdk", "CPU/req", "capacity on one core", "tracing/off", "tracing-sdk/off"} {
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
	rep, err := llmproxy.MeasureOneCore(ctx, llmproxy.OneCoreConfig{
		Command:  func(args []string) *exec.Cmd { return osmoCommand(nil, append([]string{"llmproxy"}, args...)...) },
		Requests: 1 << 30, Rounds: 2, Clients: 2,
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("MeasureOneCore with a canceled context: %v (skipped: %q), want context.Canceled", err, rep.Skipped)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("returned %s after the start, long after the cancellation", d)
	}
	assertReaped(t, rep.Off.PID, rep.Tracing.PID, rep.SDK.PID)
}

// TestBench runs `osmo bench` whole, the one-core section with this test
// binary as osmo.
func TestBench(t *testing.T) {
	t.Setenv(osmoModeEnv, "1")
	t.Setenv("GORACE", childGORACE())
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	// Small enough for a race-enabled osmo serve: the figures are not
	// judged here, only that every section runs.
	args := []string{"bench", "-n", "100", "--rollouts", "100", "--concurrency", "8", "--in-flight", "100"}
	if err := cli.Run(ctx, args, &out, &errOut); err != nil {
		t.Fatalf("osmo bench: %v\n%s", err, errOut.String())
	}
	// The proxies run at osmo's default GOGC unless the environment sets one.
	gogc := os.Getenv("GOGC")
	if gogc == "" {
		gogc = strconv.Itoa(cli.DefaultGCPercent)
	}
	for _, s := range []string{"llmproxy - direct", "proxy process on one core", "capacity on one core", "proxy GOGC=" + gogc,
		"llmproxy against reverseproxy", "Rollouts end to end", "100 in flight", "all graded when released: true"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("osmo bench output lacks %q:\n%s", s, out.String())
		}
	}
	if strings.Contains(out.String(), "skipped") {
		t.Errorf("osmo bench skipped the one-core section:\n%s", out.String())
	}
}
