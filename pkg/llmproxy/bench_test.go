package llmproxy_test

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/telemetry"
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
		Recorder:  llmproxy.RecorderFunc(func(context.Context, *osmo.LLMCall) {}),
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

// exportingTracerProvider is the proxy's span pipeline exporting every
// span over OTLP/HTTP to a loopback collector that drops them.
func exportingTracerProvider(tb testing.TB) trace.TracerProvider {
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	tb.Cleanup(sink.Close)
	ctx := context.Background()
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(sink.URL+"/v1/traces"))
	if err != nil {
		tb.Fatal(err)
	}
	tp := telemetry.NewTracerProvider(exp, sdktrace.WithSampler(sdktrace.AlwaysSample()))
	tb.Cleanup(func() { _ = tp.Shutdown(ctx) })
	return tp
}

// BenchmarkProxyTracing drives llmproxy with parallel clients with tracing
// off and on, exporting to a loopback collector; compare their req/s (osmo
// bench prints the ratio for the proxy process alone on one core).
func BenchmarkProxyTracing(b *testing.B) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		okJSON(w, r)
	}))
	b.Cleanup(up.Close)
	for _, tracing := range []string{"off", "on"} {
		b.Run(tracing, func(b *testing.B) {
			tr := &http.Transport{MaxIdleConnsPerHost: 100}
			b.Cleanup(tr.CloseIdleConnections)
			cfg := llmproxy.Config{
				Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.URL + "/v1", Model: "policy-v1"}),
				Recorder:  llmproxy.RecorderFunc(func(context.Context, *osmo.LLMCall) {}),
				Transport: tr,
			}
			if tracing == "on" {
				cfg.TracerProvider = exportingTracerProvider(b)
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
