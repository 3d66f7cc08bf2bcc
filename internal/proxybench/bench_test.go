package proxybench_test

import (
	"bytes"
	"context"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/proxybench"
	"github.com/osmo-rl/osmo/internal/telemetry"
)

// benchTracerProvider is the proxy's span pipeline (every span sampled,
// the baggage ids, batches) in front of an exporter that drops the
// batches, so the benchmark measures the proxy's side of tracing.
func benchTracerProvider(tb testing.TB) trace.TracerProvider {
	tp := telemetry.NewTracerProvider(tracetest.NewNoopExporter(), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	tb.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp
}

func TestMeasureOverhead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := proxybench.MeasureOverhead(ctx, 0, nil); err == nil {
		t.Error("MeasureOverhead(0) succeeded, want an error naming n")
	}
	// The report states the collector setting it ran under.
	defer debug.SetGCPercent(debug.SetGCPercent(250))
	// What the measurement logs reaches the standard logger (where a
	// ReverseProxy's errors go): `osmo bench` prints its tables and nothing
	// else, so nothing may.
	var logged bytes.Buffer
	log.SetOutput(&logged)
	defer log.SetOutput(os.Stderr)
	rep, err := proxybench.MeasureOverhead(ctx, 50, benchTracerProvider(t))
	if err != nil {
		t.Fatalf("MeasureOverhead: %v", err)
	}
	if logged.Len() > 0 {
		t.Errorf("MeasureOverhead logged:\n%s", logged.String())
	}
	if rep.GCPercent != 250 {
		t.Errorf("report GCPercent = %d, want the 250 in effect", rep.GCPercent)
	}
	for name, l := range map[string]proxybench.Latency{"direct": rep.Direct, "reverseproxy": rep.ReverseProxy, "llmproxy": rep.LLMProxy, "llmproxy+tracing": rep.TracedLLMProxy} {
		if l.P50 <= 0 || l.P99 < l.P50 {
			t.Errorf("%s latency %+v is not a distribution", name, l)
		}
	}
	if rep.AddedOverDirect.P50 != rep.LLMProxy.P50-rep.Direct.P50 {
		t.Errorf("added latency %v is not llmproxy minus direct", rep.AddedOverDirect)
	}
	if rep.Throughput <= 0 || rep.DirectThroughput <= 0 || rep.TracedThroughput <= 0 || rep.ReverseProxyThroughput <= 0 || rep.Requests != 50 {
		t.Errorf("report %+v lacks throughput or request count", rep)
	}
	if !rep.Traced || rep.TracingThroughputRatio() != rep.TracedThroughput/rep.Throughput {
		t.Errorf("tracing ratio %v is not traced over plain throughput (%+v)", rep.TracingThroughputRatio(), rep)
	}
	if rep.ReverseProxyThroughputRatio() != rep.Throughput/rep.ReverseProxyThroughput {
		t.Errorf("reverse proxy ratio %v is not llmproxy's throughput over its (%+v)", rep.ReverseProxyThroughputRatio(), rep)
	}
	if rp := rep.ReverseProxy.P99 - rep.Direct.P99; rp > 0 && rep.AddedP99Ratio() != float64(rep.AddedOverDirect.P99)/float64(rp) {
		t.Errorf("added p99 ratio %v is not llmproxy's added p99 over the reverse proxy's (%+v)", rep.AddedP99Ratio(), rep)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	for _, s := range []string{"direct", "reverseproxy", "llmproxy", "llmproxy+tracing", "p99", "req/s", "% of llmproxy", "GOGC=250", "llmproxy against reverseproxy"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, out.String())
		}
	}
}

// TestMeasureOneCoreSkips checks the one-core measurement reports why it
// did not run instead of failing, and refuses a configuration it cannot
// run. cli's tests run it against real proxy processes.
func TestMeasureOneCoreSkips(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := proxybench.MeasureOneCore(ctx, proxybench.OneCoreConfig{Requests: 1, Rounds: 2, Clients: 1}); err == nil {
		t.Error("MeasureOneCore with fewer requests than rounds succeeded, want an error")
	}
	commands := map[string]func([]string) *exec.Cmd{
		"no command": nil,
		"no such program": func(args []string) *exec.Cmd {
			return exec.Command(filepath.Join(t.TempDir(), "no-such-osmo"), args...)
		},
		// The test binary does not know the proxy's flags: it exits at once.
		"exits at once": func(args []string) *exec.Cmd { return exec.Command(os.Args[0], args...) },
	}
	for name, command := range commands {
		t.Run(name, func(t *testing.T) {
			rep, err := proxybench.MeasureOneCore(ctx, proxybench.OneCoreConfig{Command: command, Requests: 10, Rounds: 2, Clients: 1})
			if err != nil || rep.Skipped == "" {
				t.Fatalf("MeasureOneCore = %+v, %v; want it skipped, no error", rep, err)
			}
			t.Logf("skipped: %s", rep.Skipped)
			var out bytes.Buffer
			rep.WriteTable(&out)
			if !strings.Contains(out.String(), "skipped ("+rep.Skipped+")") {
				t.Errorf("table does not say why it skipped:\n%s", out.String())
			}
			if runtime.GOOS == "linux" && name != "no command" && !strings.Contains(rep.Skipped, "did not start") {
				t.Errorf("skipped because %q, want the proxy that did not start named", rep.Skipped)
			}
		})
	}
}

// TestOneCoreReverseProxyRatios checks the comparison with the reverse
// proxy: added latency over direct, and nothing when it was not measured.
func TestOneCoreReverseProxyRatios(t *testing.T) {
	setup := func(name string, p99 time.Duration, requests int, wall, cpu time.Duration) proxybench.OneCoreSetup {
		return proxybench.OneCoreSetup{Name: name, Requests: requests, Wall: wall, CPU: cpu, Latency: proxybench.Latency{P50: p99 / 2, P99: p99}}
	}
	rep := proxybench.OneCoreReport{
		Off:          setup("off", 700*time.Microsecond, 1000, time.Second, 200*time.Millisecond),
		ReverseProxy: setup("reverseproxy", 500*time.Microsecond, 1000, 800*time.Millisecond, 100*time.Millisecond),
		Direct:       setup("direct", 300*time.Microsecond, 1000, 500*time.Millisecond, 0),
	}
	// (700-300)/(500-300): the proxy adds twice the reverse proxy's tail.
	if got := rep.AddedP99Ratio(); got != 2 {
		t.Errorf("AddedP99Ratio = %v, want 2", got)
	}
	if got := rep.ReverseProxyThroughputRatio(); got != 0.8 {
		t.Errorf("ReverseProxyThroughputRatio = %v, want 0.8 (1000/s against 1250/s)", got)
	}
	if got := rep.ReverseProxyCPURatio(); got != 2 {
		t.Errorf("ReverseProxyCPURatio = %v, want 2", got)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	if !strings.Contains(out.String(), "off against reverseproxy: added p99 2.00x (+400.0µs against +200.0µs over direct), req/s 0.80x, CPU per request 2.00x") {
		t.Errorf("table lacks the comparison:\n%s", out.String())
	}

	// A reverse proxy whose tail came out shorter than a direct call's
	// leaves nothing to compare with: the table says so, not 0x.
	rep.ReverseProxy.Latency.P99 = 250 * time.Microsecond
	out.Reset()
	rep.WriteTable(&out)
	if rep.AddedP99Ratio() != 0 || !strings.Contains(out.String(), "added p99 n/a") {
		t.Errorf("AddedP99Ratio = %v against a reverse proxy faster than direct; table:\n%s", rep.AddedP99Ratio(), out.String())
	}

	rep.ReverseProxy = proxybench.OneCoreSetup{}
	if rep.AddedP99Ratio() != 0 || rep.ReverseProxyThroughputRatio() != 0 || rep.ReverseProxyCPURatio() != 0 {
		t.Error("ratios to a reverse proxy that was not measured are not 0")
	}
	out.Reset()
	rep.WriteTable(&out)
	if strings.Contains(out.String(), "reverseproxy\t") || strings.Contains(out.String(), "against reverseproxy") {
		t.Errorf("table shows a reverse proxy that was not measured:\n%s", out.String())
	}
}
