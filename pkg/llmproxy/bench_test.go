package llmproxy_test

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// benchRequestBody is the small chat completion every setup sends.
const benchRequestBody = `{"model":"openai/osmosis-rollout","messages":[{"role":"system","content":"You are a calculator."},{"role":"user","content":"What is 2 + 2?"}],"temperature":1.0,"max_tokens":16}`

// benchSetups starts one upstream and the three ways to reach it; it
// returns the chat-completions URL of each.
func benchSetups(b *testing.B) map[string]string {
	b.Helper()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		okJSON(w, r)
	}))
	b.Cleanup(up.Close)
	target, _ := url.Parse(up.URL)

	rpTransport := &http.Transport{MaxIdleConnsPerHost: 100}
	b.Cleanup(rpTransport.CloseIdleConnections)
	rp := httptest.NewServer(&httputil.ReverseProxy{
		Rewrite:   func(pr *httputil.ProxyRequest) { pr.SetURL(target) },
		Transport: rpTransport,
	})
	b.Cleanup(rp.Close)

	lpTransport := &http.Transport{MaxIdleConnsPerHost: 100}
	b.Cleanup(lpTransport.CloseIdleConnections)
	p, err := llmproxy.New(llmproxy.Config{
		Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.URL + "/v1", Model: "policy-v1"}),
		Recorder:  llmproxy.RecorderFunc(func(context.Context, *llmproxy.Call) {}),
		Transport: lpTransport,
	})
	if err != nil {
		b.Fatal(err)
	}
	lp := httptest.NewServer(p)
	b.Cleanup(lp.Close)
	return map[string]string{
		"direct":       up.URL + "/v1/chat/completions",
		"reverseproxy": rp.URL + "/v1/chat/completions",
		"llmproxy":     lp.URL + "/v1/chat/completions",
	}
}

func benchClient(b *testing.B) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 256}
	b.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func doBenchRequest(b *testing.B, c *http.Client, target string) {
	req, _ := http.NewRequest(http.MethodPost, target, strings.NewReader(benchRequestBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(llmproxy.HeaderRolloutID, "bench")
	req.Header.Set(llmproxy.HeaderSampleID, "s0")
	resp, err := c.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		b.Fatalf("%s: status %d, %v", target, resp.StatusCode, err)
	}
}

func reportPercentiles(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	at := func(p int) float64 {
		i := max((len(lat)*p+99)/100-1, 0)
		return float64(lat[i]) / float64(time.Microsecond)
	}
	b.ReportMetric(at(50), "p50-µs")
	b.ReportMetric(at(99), "p99-µs")
}

// BenchmarkProxyOverhead compares one request in flight sent straight to
// the upstream, through httputil.ReverseProxy and through llmproxy.
func BenchmarkProxyOverhead(b *testing.B) {
	targets := benchSetups(b)
	for _, name := range []string{"direct", "reverseproxy", "llmproxy"} {
		b.Run(name, func(b *testing.B) {
			c := benchClient(b)
			for range 100 { // warm the connections
				doBenchRequest(b, c, targets[name])
			}
			lat := make([]time.Duration, 0, 1<<16)
			b.ReportAllocs()
			for b.Loop() {
				t0 := time.Now()
				doBenchRequest(b, c, targets[name])
				lat = append(lat, time.Since(t0))
			}
			reportPercentiles(b, lat)
		})
	}
}

// BenchmarkProxyThroughput drives llmproxy with parallel clients.
func BenchmarkProxyThroughput(b *testing.B) {
	target := benchSetups(b)["llmproxy"]
	c := benchClient(b)
	b.SetParallelism(8)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			doBenchRequest(b, c, target)
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// benchTracerProvider is the proxy's span pipeline (every span sampled,
// the baggage ids, batches) in front of an exporter that drops the
// batches, so the benchmark measures the proxy's side of tracing.
func benchTracerProvider(tb testing.TB) trace.TracerProvider {
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: otlpdirect.Discard(), Sampler: sdktrace.AlwaysSample()})
	tb.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp
}

// exportingTracerProvider is a span pipeline exporting every span over
// OTLP/HTTP to a loopback collector that drops them: the direct pipeline
// or the OpenTelemetry SDK's (the SDK's OTLP exporter included, which
// encodes the spans).
func exportingTracerProvider(tb testing.TB, pipeline string) trace.TracerProvider {
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	tb.Cleanup(sink.Close)
	ctx := context.Background()
	if pipeline == telemetry.PipelineSDK {
		exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(sink.URL+"/v1/traces"))
		if err != nil {
			tb.Fatal(err)
		}
		tp := telemetry.NewTracerProvider(exp, nil, sdktrace.AlwaysSample())
		tb.Cleanup(func() { _ = tp.Shutdown(ctx) })
		return tp
	}
	exp := otlpdirect.NewHTTPExporter(otlpdirect.HTTPConfig{URL: sink.URL + "/v1/traces"})
	tp := otlpdirect.NewTracerProvider(otlpdirect.Config{Exporter: exp, Sampler: sdktrace.AlwaysSample()})
	tb.Cleanup(func() { _ = tp.Shutdown(ctx); _ = exp.Shutdown(ctx) })
	return tp
}

// BenchmarkProxyTracing drives llmproxy with parallel clients with tracing
// off, on through the direct span pipeline and on through the SDK's, both
// exporting to a loopback collector; compare their req/s (osmo bench
// prints the ratios for the proxy process alone on one core).
func BenchmarkProxyTracing(b *testing.B) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		okJSON(w, r)
	}))
	b.Cleanup(up.Close)
	for _, pipeline := range []string{"off", telemetry.PipelineDirect, telemetry.PipelineSDK} {
		b.Run(pipeline, func(b *testing.B) {
			tr := &http.Transport{MaxIdleConnsPerHost: 100}
			b.Cleanup(tr.CloseIdleConnections)
			cfg := llmproxy.Config{
				Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.URL + "/v1", Model: "policy-v1"}),
				Recorder:  llmproxy.RecorderFunc(func(context.Context, *llmproxy.Call) {}),
				Transport: tr,
			}
			if pipeline != "off" {
				cfg.TracerProvider = exportingTracerProvider(b, pipeline)
			}
			p, err := llmproxy.New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			lp := httptest.NewServer(p)
			b.Cleanup(lp.Close)
			target := lp.URL + "/v1/chat/completions"
			c := benchClient(b)
			b.SetParallelism(8)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					doBenchRequest(b, c, target)
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
		})
	}
}

// BenchmarkProxySSE streams a 64-chunk completion through llmproxy and
// checks every chunk arrives intact and in order.
func BenchmarkProxySSE(b *testing.B) {
	const chunks = 64
	var want bytes.Buffer
	for i := range chunks {
		want.WriteString(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok` + strings.Repeat("x", i%7) + `"},"token_ids":[` + string(rune('1'+i%9)) + `]}]}` + "\n\n")
	}
	want.WriteString("data: [DONE]\n\n")
	events := bytes.SplitAfter(want.Bytes(), []byte("\n\n"))
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, e := range events {
			_, _ = w.Write(e)
			w.(http.Flusher).Flush()
		}
	}))
	b.Cleanup(up.Close)
	p, err := llmproxy.New(llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.URL + "/v1"})})
	if err != nil {
		b.Fatal(err)
	}
	lp := httptest.NewServer(p)
	b.Cleanup(lp.Close)
	c := benchClient(b)
	body := `{"stream":true,"messages":[{"role":"user","content":"count"}]}`

	b.ReportAllocs()
	for b.Loop() {
		req, _ := http.NewRequest(http.MethodPost, lp.URL+"/r/bench/s/s0/v1/chat/completions", strings.NewReader(body))
		resp, err := c.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		br := bufio.NewReader(resp.Body)
		n := 0
		var got bytes.Buffer
		for {
			line, err := br.ReadBytes('\n')
			got.Write(line)
			if err != nil {
				break
			}
			if len(line) == 1 {
				n++
			}
		}
		resp.Body.Close()
		if n != chunks+1 || !bytes.Equal(got.Bytes(), want.Bytes()) {
			b.Fatalf("got %d events (%d bytes), want %d events unchanged", n, got.Len(), chunks+1)
		}
	}
	b.ReportMetric(chunks+1, "events/op")
}

func TestMeasureOverhead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := llmproxy.MeasureOverhead(ctx, 0, nil); err == nil {
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
	rep, err := llmproxy.MeasureOverhead(ctx, 50, benchTracerProvider(t))
	if err != nil {
		t.Fatalf("MeasureOverhead: %v", err)
	}
	if logged.Len() > 0 {
		t.Errorf("MeasureOverhead logged:\n%s", logged.String())
	}
	if rep.GCPercent != 250 {
		t.Errorf("report GCPercent = %d, want the 250 in effect", rep.GCPercent)
	}
	for name, l := range map[string]llmproxy.Latency{"direct": rep.Direct, "reverseproxy": rep.ReverseProxy, "llmproxy": rep.LLMProxy, "llmproxy+tracing": rep.TracedLLMProxy} {
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
	if _, err := llmproxy.MeasureOneCore(ctx, llmproxy.OneCoreConfig{Requests: 1, Rounds: 2, Clients: 1}); err == nil {
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
			rep, err := llmproxy.MeasureOneCore(ctx, llmproxy.OneCoreConfig{Command: command, Requests: 10, Rounds: 2, Clients: 1})
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
