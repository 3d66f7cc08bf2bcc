// Package proxybench measures what pkg/llmproxy adds to a call: in one
// process against a plain httputil.ReverseProxy and a direct call
// (MeasureOverhead), and as its own process alone on one core
// (MeasureOneCore). `osmo bench` prints both.
package proxybench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"runtime"
	rtmetrics "runtime/metrics"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// Latency summarizes a latency distribution.
type Latency struct {
	P50, P99 time.Duration
}

// OverheadReport compares the latency of one small chat completion sent
// straight to an upstream, through a plain httputil.ReverseProxy and through
// this proxy (with and without tracing), all over loopback in one process.
type OverheadReport struct {
	// Requests is the number of timed sequential requests per setup.
	Requests     int
	Direct       Latency
	ReverseProxy Latency
	LLMProxy     Latency
	// AddedOverDirect and AddedOverReverseProxy are LLMProxy minus the other
	// setup, percentile by percentile.
	AddedOverDirect       Latency
	AddedOverReverseProxy Latency
	// Traced reports whether the llmproxy setup with tracing was measured;
	// TracedLLMProxy is its latency.
	Traced         bool
	TracedLLMProxy Latency
	// Throughput is llmproxy's rate with ThroughputClients concurrent clients
	// over ThroughputDuration; DirectThroughput the same load without it.
	// TracedThroughput is llmproxy's rate with tracing on, measured in
	// rounds alternating with Throughput's so both see the same machine.
	// Client, proxy and upstream share the GOMAXPROCS CPUs.
	// ReverseProxyThroughput is the plain ReverseProxy's, measured in the
	// same alternating rounds.
	Throughput             float64
	TracedThroughput       float64
	ReverseProxyThroughput float64
	DirectThroughput       float64
	ThroughputClients      int
	ThroughputDuration     time.Duration
	GOMAXPROCS             int
	// GCPercent is the garbage collector's GOGC during the run (-1: off).
	// Client, proxy and upstream share one heap, and how often it is
	// collected moves the p99 of every setup (see docs/deploy.md).
	GCPercent int
}

// TracingThroughputRatio is TracedThroughput over Throughput: 0.95 means
// tracing cost the proxy 5% of its throughput. It is 0 when tracing was not
// measured.
func (r OverheadReport) TracingThroughputRatio() float64 {
	return ratio(r.TracedThroughput, r.Throughput)
}

// AddedP99Ratio is the p99 this proxy adds over a direct call divided by
// the p99 a plain httputil.ReverseProxy adds, in the same run: below 1 the
// proxy's tail is shorter than the reverse proxy's. 0 when the reverse
// proxy added nothing measurable.
func (r OverheadReport) AddedP99Ratio() float64 {
	return addedRatio(r.AddedOverDirect.P99, r.ReverseProxy.P99-r.Direct.P99)
}

// ReverseProxyThroughputRatio is Throughput over ReverseProxyThroughput.
func (r OverheadReport) ReverseProxyThroughputRatio() float64 {
	return ratio(r.Throughput, r.ReverseProxyThroughput)
}

// ratio is a/b, 0 when b is not positive (nothing measured).
func ratio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

// addedRatio is what the proxy added over what the reverse proxy added; 0
// when the reverse proxy added nothing, whose tail is then noise.
func addedRatio(proxy, reverse time.Duration) float64 { return ratio(float64(proxy), float64(reverse)) }

// WriteTable prints the report as a table.
func (r OverheadReport) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "in one process: latency with one request in flight, loopback\n\n")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "setup\tp50\tp99\t\n")
	for _, row := range []struct {
		name string
		l    Latency
	}{{"direct", r.Direct}, {"reverseproxy", r.ReverseProxy}, {"llmproxy", r.LLMProxy}} {
		fmt.Fprintf(tw, "%s\t%s\t%s\t\n", row.name, micros(row.l.P50), micros(row.l.P99))
	}
	if r.Traced {
		fmt.Fprintf(tw, "llmproxy+tracing\t%s\t%s\t\n", micros(r.TracedLLMProxy.P50), micros(r.TracedLLMProxy.P99))
	}
	fmt.Fprintf(tw, "llmproxy - direct\t%s\t%s\t\n", signedMicros(r.AddedOverDirect.P50), signedMicros(r.AddedOverDirect.P99))
	fmt.Fprintf(tw, "llmproxy - reverseproxy\t%s\t%s\t\n", signedMicros(r.AddedOverReverseProxy.P50), signedMicros(r.AddedOverReverseProxy.P99))
	if r.Traced {
		fmt.Fprintf(tw, "llmproxy+tracing - llmproxy\t%s\t%s\t\n",
			signedMicros(r.TracedLLMProxy.P50-r.LLMProxy.P50), signedMicros(r.TracedLLMProxy.P99-r.LLMProxy.P99))
	}
	_ = tw.Flush()
	gogc := "off"
	if r.GCPercent >= 0 {
		gogc = strconv.Itoa(r.GCPercent)
	}
	fmt.Fprintf(w, "\n%d sequential requests per setup, interleaved; loopback; GOMAXPROCS=%d; GOGC=%s\n", r.Requests, r.GOMAXPROCS, gogc)
	fmt.Fprintf(w, "client, upstream and proxies share this process and its CPUs: the throughput below is the whole\n")
	fmt.Fprintf(w, "process's, not the proxy's alone (see the one-core section for that)\n")
	fmt.Fprintf(w, "throughput with %d concurrent clients over %s: llmproxy %.0f req/s, reverseproxy %.0f req/s, direct %.0f req/s\n",
		r.ThroughputClients, r.ThroughputDuration, r.Throughput, r.ReverseProxyThroughput, r.DirectThroughput)
	fmt.Fprintf(w, "llmproxy against reverseproxy, recording every call: added p99 %s, req/s %.2fx\n",
		addedP99Ratio(r.AddedP99Ratio()), r.ReverseProxyThroughputRatio())
	if r.Traced {
		fmt.Fprintf(w, "tracing on (every span sampled, batch export to an exporter that drops them): llmproxy+tracing %.0f req/s = %.1f%% of llmproxy (%+.1f%%)\n",
			r.TracedThroughput, 100*r.TracingThroughputRatio(), 100*(r.TracingThroughputRatio()-1))
	}
}

// gcPercent reads the collector's current GOGC without changing it.
func gcPercent() int {
	s := []rtmetrics.Sample{{Name: "/gc/gogc:percent"}}
	rtmetrics.Read(s)
	if s[0].Value.Kind() != rtmetrics.KindUint64 {
		return 100
	}
	v := s[0].Value.Uint64()
	if v > math.MaxInt32 { // GOGC=off reads as a huge percentage
		return -1
	}
	return int(v)
}

// addedP99Ratio prints an AddedP99Ratio. 0 means the reverse proxy's p99
// was no longer than a direct call's: on a busy machine the tail is noise,
// and a ratio to it would read as a result.
func addedP99Ratio(r float64) string {
	if r == 0 {
		return "n/a (reverseproxy added no p99 over direct: the tails are noise; rerun on a quiet machine)"
	}
	return fmt.Sprintf("%.2fx", r)
}

func micros(d time.Duration) string {
	return fmt.Sprintf("%.1fµs", float64(d)/float64(time.Microsecond))
}

func signedMicros(d time.Duration) string {
	return fmt.Sprintf("%+.1fµs", float64(d)/float64(time.Microsecond))
}

// benchBody is a small chat completion request.
const benchBody = `{"model":"openai/osmosis-rollout","messages":[{"role":"system","content":"You are a calculator."},{"role":"user","content":"What is 2 + 2?"}],"temperature":1.0,"max_tokens":16}`

// benchCompletion is what the in-process upstream answers.
const benchCompletion = `{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench-policy","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop"}],"usage":{"prompt_tokens":21,"completion_tokens":1,"total_tokens":22}}`

// MeasureOverhead measures what the proxy adds to a call: n sequential
// requests for each of direct, reverseproxy and llmproxy, interleaved round
// robin so machine noise hits all three alike, then a throughput run with
// concurrent clients. With a TracerProvider, a fourth setup, llmproxy
// tracing every call through tp, is measured alongside: its latency in the
// same rounds and its throughput in runs alternating with llmproxy's.
// Everything runs in this process on 127.0.0.1.
func MeasureOverhead(ctx context.Context, n int, tp trace.TracerProvider) (OverheadReport, error) {
	if n <= 0 {
		return OverheadReport{}, fmt.Errorf("proxybench.MeasureOverhead: n must be positive, got %d", n)
	}
	rep := OverheadReport{Requests: n, GOMAXPROCS: runtime.GOMAXPROCS(0), GCPercent: gcPercent(), Traced: tp != nil}
	// Long enough to be steady for real runs, short for smoke tests.
	rep.ThroughputDuration = min(2*time.Second, max(250*time.Millisecond, time.Duration(n)*400*time.Microsecond))
	rep.ThroughputClients = max(8, 4*rep.GOMAXPROCS)

	var stack benchStack
	defer stack.close()
	if err := stack.start(tp); err != nil {
		return rep, fmt.Errorf("proxybench.MeasureOverhead: %w", err)
	}
	targets := []string{stack.upstreamURL, stack.reverseURL, stack.proxyURL}
	if tp != nil {
		targets = append(targets, stack.tracedURL)
	}
	clients := make([]*http.Client, len(targets))
	for i := range clients {
		clients[i] = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: rep.ThroughputClients, DisableCompression: true}}
		defer clients[i].CloseIdleConnections()
	}

	// Warm connections, pools and code paths.
	warm := min(n, 200)
	for range warm {
		for i, t := range targets {
			if err := benchRequest(ctx, clients[i], t); err != nil {
				return rep, fmt.Errorf("proxybench.MeasureOverhead: warm-up: %w", err)
			}
		}
	}
	lat := make([][]time.Duration, len(targets))
	for i := range lat {
		lat[i] = make([]time.Duration, 0, n)
	}
	for range n {
		for i, t := range targets {
			t0 := time.Now()
			if err := benchRequest(ctx, clients[i], t); err != nil {
				return rep, fmt.Errorf("proxybench.MeasureOverhead: %w", err)
			}
			lat[i] = append(lat[i], time.Since(t0))
		}
	}
	rep.Direct, rep.ReverseProxy, rep.LLMProxy = summarize(lat[0]), summarize(lat[1]), summarize(lat[2])
	rep.AddedOverDirect = Latency{P50: rep.LLMProxy.P50 - rep.Direct.P50, P99: rep.LLMProxy.P99 - rep.Direct.P99}
	rep.AddedOverReverseProxy = Latency{P50: rep.LLMProxy.P50 - rep.ReverseProxy.P50, P99: rep.LLMProxy.P99 - rep.ReverseProxy.P99}
	if tp != nil {
		rep.TracedLLMProxy = summarize(lat[3])
	}

	// llmproxy with and without tracing and the reverse proxy run in short
	// alternating rounds, each going first in turn, so drifts in machine
	// load hit them alike.
	rounds := max(4, int(rep.ThroughputDuration/(100*time.Millisecond)))
	slice := rep.ThroughputDuration / time.Duration(rounds)
	type setup struct {
		run    *throughputRun
		client *http.Client
		target string
	}
	var plain, traced, reverse throughputRun
	for i := range rounds {
		runs := []setup{{&plain, clients[2], stack.proxyURL}, {&reverse, clients[1], stack.reverseURL}}
		if tp != nil {
			runs = append(runs, setup{&traced, clients[3], stack.tracedURL})
		}
		for j := range runs {
			r := runs[(i+j)%len(runs)]
			if err := r.run.add(ctx, r.client, r.target, rep.ThroughputClients, slice); err != nil {
				return rep, fmt.Errorf("proxybench.MeasureOverhead: throughput: %w", err)
			}
		}
	}
	rep.Throughput, rep.TracedThroughput, rep.ReverseProxyThroughput = plain.rate(), traced.rate(), reverse.rate()
	var direct throughputRun
	if err := direct.add(ctx, clients[0], stack.upstreamURL, rep.ThroughputClients, rep.ThroughputDuration); err != nil {
		return rep, fmt.Errorf("proxybench.MeasureOverhead: throughput: %w", err)
	}
	rep.DirectThroughput = direct.rate()
	return rep, nil
}

// throughputRun adds up the requests and time of several throughput runs.
type throughputRun struct {
	requests int64
	elapsed  time.Duration
}

func (t *throughputRun) rate() float64 {
	if t.elapsed <= 0 {
		return 0
	}
	return float64(t.requests) / t.elapsed.Seconds()
}

// benchStack is the upstream and the proxies in front of it.
type benchStack struct {
	servers                                      []*http.Server
	transports                                   []*http.Transport
	upstreamURL, reverseURL, proxyURL, tracedURL string
}

func (s *benchStack) serve(h http.Handler) (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	s.servers = append(s.servers, srv)
	go func() { _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String(), nil
}

func (s *benchStack) start(tp trace.TracerProvider) error {
	base, err := s.serve(http.HandlerFunc(benchUpstream))
	if err != nil {
		return err
	}
	s.upstreamURL = base + "/v1/chat/completions"
	target, _ := url.Parse(base)
	tr := llmproxy.DefaultTransport()
	s.transports = append(s.transports, tr)
	if s.reverseURL, err = s.serve(newReverseProxy(target, tr)); err != nil {
		return err
	}
	s.reverseURL += "/v1/chat/completions"
	if s.proxyURL, err = s.serveProxy(base, nil); err != nil || tp == nil {
		return err
	}
	s.tracedURL, err = s.serveProxy(base, tp)
	return err
}

// serveProxy serves a proxy to the upstream at base that records nothing,
// tracing every call through tp when it is not nil, and returns its chat
// completions URL.
func (s *benchStack) serveProxy(base string, tp trace.TracerProvider) (string, error) {
	tr := llmproxy.DefaultTransport()
	s.transports = append(s.transports, tr)
	p, err := llmproxy.New(llmproxy.Config{
		Router:         llmproxy.StaticRouter(llmproxy.Route{BaseURL: base + "/v1", Model: "bench-policy"}),
		Recorder:       llmproxy.RecorderFunc(func(context.Context, *osmo.LLMCall) {}),
		Transport:      tr,
		TracerProvider: tp,
	})
	if err != nil {
		return "", err
	}
	u, err := s.serve(p)
	return u + "/v1/chat/completions", err
}

func (s *benchStack) close() {
	for _, srv := range s.servers {
		_ = srv.Close()
	}
	for _, t := range s.transports {
		t.CloseIdleConnections()
	}
}

// benchRequest sends one chat completion and reads the whole answer.
func benchRequest(ctx context.Context, c *http.Client, target string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader([]byte(benchBody)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(llmproxy.HeaderRolloutID, "bench")
	req.Header.Set(llmproxy.HeaderSampleID, "s0")
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s answered %d", target, resp.StatusCode)
	}
	return nil
}

// add runs clients concurrent request loops for d and adds the requests
// completed and the time taken.
func (t *throughputRun) add(ctx context.Context, c *http.Client, target string, clients int, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var (
		done    atomic.Int64
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
	)
	start := time.Now()
	for range clients {
		wg.Go(func() {
			for ctx.Err() == nil {
				if err := benchRequest(ctx, c, target); err != nil {
					if ctx.Err() == nil {
						errOnce.Do(func() { first = err; cancel() })
					}
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if first != nil {
		return first
	}
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	t.requests += done.Load()
	t.elapsed += elapsed
	return nil
}

// summarize returns the nearest-rank percentiles of lat (sorted in place).
func summarize(lat []time.Duration) Latency {
	slices.Sort(lat)
	return Latency{P50: percentile(lat, 50), P99: percentile(lat, 99)}
}

func percentile(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := (len(sorted)*p + 99) / 100 // ceil(n*p/100)
	return sorted[max(i-1, 0)]
}
