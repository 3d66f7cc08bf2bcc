package llmproxy_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// engineDouble is a policy engine on a real loopback server: it answers
// /health, and /v1/chat/completions with its handler, counting the
// sessions it saw.
type engineDouble struct {
	srv  *httptest.Server
	base string
	mu   sync.Mutex
	seen map[string]int // X-Session-ID → calls
}

func newEngineDouble(t *testing.T, chat http.HandlerFunc) *engineDouble {
	t.Helper()
	d := &engineDouble{seen: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		d.mu.Lock()
		d.seen[r.Header.Get(llmproxy.HeaderSessionID)]++
		d.mu.Unlock()
		chat(w, r)
	})
	d.srv = httptest.NewServer(mux)
	t.Cleanup(d.srv.Close)
	d.base = d.srv.URL + "/v1"
	return d
}

func (d *engineDouble) sessions() map[string]int {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string]int, len(d.seen))
	for k, v := range d.seen {
		out[k] = v
	}
	return out
}

// runEngines builds an engine set and runs it for the test.
func runEngines(t *testing.T, cfg llmproxy.EnginesConfig) *llmproxy.Engines {
	t.Helper()
	s, err := llmproxy.NewEngines(cfg)
	if err != nil {
		t.Fatalf("NewEngines: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := s.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return s
}

// waitFor polls cond until it holds or within passes.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > within {
			t.Fatalf("%s: not within %s", what, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}

func TestEnginesAffinityAndSessions(t *testing.T) {
	const (
		engines = 4
		samples = 64
		turns   = 5
	)
	var doubles []*engineDouble
	var urls []string
	for range engines {
		d := newEngineDouble(t, okJSON)
		doubles = append(doubles, d)
		urls = append(urls, d.base)
	}
	set := runEngines(t, llmproxy.EnginesConfig{URLs: urls})
	var mu sync.Mutex
	var records []*osmo.LLMCall
	h := newProxy(t, llmproxy.Config{
		Router:  llmproxy.StaticRouter(llmproxy.Route{}),
		Engines: set,
		Recorder: llmproxy.RecorderFunc(func(_ context.Context, c *osmo.LLMCall) {
			mu.Lock()
			records = append(records, c)
			mu.Unlock()
		}),
	})
	var wg sync.WaitGroup
	for s := range samples {
		wg.Go(func() {
			for range turns {
				resp, body := post(t, h.url+llmproxy.BaseURLFor("", "roll/"+strconv.Itoa(s/4), strconv.Itoa(s%4))+"/chat/completions", chatBody, nil)
				if resp.StatusCode != http.StatusOK {
					t.Errorf("status %d: %s", resp.StatusCode, body)
				}
			}
		})
	}
	wg.Wait()

	// Each sample has one session id, seen on one engine, distinct from
	// every other sample's.
	bySession := map[string]map[int]int{} // session → engine → calls
	for i, d := range doubles {
		for sess, n := range d.sessions() {
			if sess == "" {
				t.Fatalf("engine %d got calls without %s", i, llmproxy.HeaderSessionID)
			}
			if bySession[sess] == nil {
				bySession[sess] = map[int]int{}
			}
			bySession[sess][i] += n
		}
	}
	if len(bySession) != samples {
		t.Fatalf("%d session ids for %d samples", len(bySession), samples)
	}
	onHome, used := 0, map[int]bool{}
	for _, perEngine := range bySession {
		most := 0
		for i, n := range perEngine {
			most = max(most, n)
			used[i] = true
		}
		onHome += most
	}
	if rate := float64(onHome) / (samples * turns); rate < 0.99 {
		t.Errorf("%.3f of a sample's calls on its engine, want at least 0.99", rate)
	}
	if len(used) != engines {
		t.Errorf("calls reached %d of %d engines", len(used), engines)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, c := range records {
		if c.Engine == "" || len(c.UpstreamAttempts) != 1 || c.UpstreamAttempts[0].Engine != c.Engine || c.UpstreamAttempts[0].StatusCode != 200 {
			t.Fatalf("record of a healthy call: engine %q, attempts %+v", c.Engine, c.UpstreamAttempts)
		}
	}
}

func TestEnginesFailover(t *testing.T) {
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	cases := []struct {
		name string
		bad  func(t *testing.T) string // the bad engine's base URL
		want string                    // in the failed attempt's error
	}{
		{"refused", func(t *testing.T) string {
			d := newEngineDouble(t, okJSON)
			d.srv.Close()
			return d.base
		}, "refused"},
		{"5xx", func(t *testing.T) string {
			return newEngineDouble(t, func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "engine is sick", http.StatusServiceUnavailable)
			}).base
		}, "503"},
		{"timeout", func(t *testing.T) string {
			return newEngineDouble(t, func(_ http.ResponseWriter, r *http.Request) {
				select {
				case <-r.Context().Done():
				case <-hang:
				}
			}).base
		}, "timeout"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bad := tc.bad(t)
			good := newEngineDouble(t, okJSON).base
			// Probes are left out of it: the calls find the bad engine.
			set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{bad, good}, ProbeInterval: time.Hour})
			h := newProxy(t, llmproxy.Config{
				Router:  llmproxy.StaticRouter(llmproxy.Route{}),
				Engines: set,
				Timeout: 500 * time.Millisecond,
				// A wait this long would fail the test: a failover to
				// another engine goes at once.
				Retry: llmproxy.RetryPolicy{MaxRetries: 2, BaseDelay: time.Minute},
			})
			hit := 0
			for s := range 20 {
				resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", strconv.Itoa(s))+"/chat/completions", chatBody, nil)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("sample %d: status %d: %s", s, resp.StatusCode, body)
				}
				c := h.next(t)
				if c.Engine != good {
					t.Fatalf("sample %d answered by %q, want %q", s, c.Engine, good)
				}
				if c.UpstreamAttempts[0].Engine != bad {
					if len(c.UpstreamAttempts) != 1 || c.Attempts != 1 {
						t.Fatalf("sample %d: attempts %d %+v", s, c.Attempts, c.UpstreamAttempts)
					}
					continue
				}
				hit++
				if c.Attempts != 2 || len(c.UpstreamAttempts) != 2 || c.UpstreamAttempts[1] != (osmo.UpstreamAttempt{Attempt: 2, Engine: good, StatusCode: 200}) {
					t.Fatalf("sample %d: attempts %d %+v", s, c.Attempts, c.UpstreamAttempts)
				}
				if e := c.UpstreamAttempts[0].Error; !strings.Contains(e, tc.want) {
					t.Fatalf("failed attempt's error %q does not say %q", e, tc.want)
				}
			}
			if hit == 0 {
				t.Fatal("no sample's call went to the bad engine first")
			}
			// Failed calls took the bad engine out of the ring.
			if set.Up(bad) {
				t.Fatalf("the bad engine is still up after %d failed calls", hit)
			}
		})
	}
}

// relisten serves handler again on addr, the address of a server that
// was closed.
func relisten(t *testing.T, addr string, handler http.Handler) {
	t.Helper()
	var ln net.Listener
	var err error
	for range 50 {
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("listening again on %s: %v", addr, err)
	}
	srv := &http.Server{Handler: handler}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
}

func TestEngineLeavesWithinThreeSecondsAndComesBack(t *testing.T) {
	a, b := newEngineDouble(t, okJSON), newEngineDouble(t, okJSON)
	// The default probe interval: it must meet the 3 s. The timeout is
	// longer than the default so that a loaded test machine does not take
	// the live engine out.
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{a.base, b.base}, ProbeTimeout: 2 * time.Second, ProbeMaxInterval: 2 * time.Second})
	if !set.Up(a.base) || !set.Up(b.base) {
		t.Fatal("engines start up")
	}
	addr := a.srv.Listener.Addr().String()
	a.srv.Close()
	took := waitFor(t, 3*time.Second, "the dead engine leaves the ring", func() bool { return !set.Up(a.base) })
	t.Logf("left after %s", took)
	if !set.Up(b.base) {
		t.Fatal("the live engine left too")
	}

	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{}), Engines: set})
	for s := range 10 {
		resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", strconv.Itoa(s))+"/chat/completions", chatBody, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		if c := h.next(t); c.Attempts != 1 || c.Engine != b.base {
			t.Fatalf("with the dead engine out, a call took %d attempts on %q", c.Attempts, c.Engine)
		}
	}

	relisten(t, addr, a.srv.Config.Handler)
	waitFor(t, 8*time.Second, "the engine comes back after probes", func() bool { return set.Up(a.base) })
}

func TestEngineThatHangsLeaves(t *testing.T) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	hung := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(hung.Close)
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{hung.URL + "/v1"}, ProbeInterval: 100 * time.Millisecond, ProbeTimeout: 100 * time.Millisecond})
	waitFor(t, 3*time.Second, "a hung engine leaves the ring", func() bool { return !set.Up(hung.URL + "/v1") })
}

// TestCallOnAHungEngineMovesWhenItLeaves: a call waiting on an engine that
// hangs goes to another engine as soon as a probe takes the hung one out
// of the ring, not when its own attempt timeout (a minute here) ends; the
// record shows the cut try on the hung engine, then the answer.
func TestCallOnAHungEngineMovesWhenItLeaves(t *testing.T) {
	release := make(chan struct{})
	hang := func(_ http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}
	// The hung engine answers its health probe until the call is on it,
	// then hangs there too.
	var hung atomic.Bool
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" && !hung.Load() {
			return
		}
		if r.URL.Path != "/health" {
			hung.Store(true)
		}
		hang(w, r)
	}))
	t.Cleanup(bad.Close)
	// Cleanups run last first: the hung handlers are released before
	// bad.Close waits for them.
	t.Cleanup(func() { close(release) })
	good := newEngineDouble(t, okJSON).base
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{bad.URL + "/v1", good}, ProbeInterval: 100 * time.Millisecond, ProbeTimeout: 200 * time.Millisecond})
	h := newProxy(t, llmproxy.Config{
		Router:  llmproxy.StaticRouter(llmproxy.Route{}),
		Engines: set,
		Timeout: time.Minute,
		Retry:   llmproxy.RetryPolicy{MaxRetries: 2, BaseDelay: time.Minute},
	})
	// A sample whose first engine is the hung one.
	for s := range 40 {
		start := time.Now()
		resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", strconv.Itoa(s))+"/chat/completions", chatBody, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("sample %d: status %d: %s", s, resp.StatusCode, body)
		}
		c := h.next(t)
		if c.UpstreamAttempts[0].Engine != bad.URL+"/v1" {
			continue
		}
		if took := time.Since(start); took > 30*time.Second {
			t.Fatalf("the call took %s: it waited out its timeout", took)
		}
		if c.Engine != good || len(c.UpstreamAttempts) != 2 || !strings.Contains(c.UpstreamAttempts[0].Error, "left the ring") {
			t.Fatalf("record: engine %q, attempts %+v", c.Engine, c.UpstreamAttempts)
		}
		return
	}
	t.Fatal("no sample's call went to the hung engine first")
}

func TestEnginesProbeModelsWithoutHealth(t *testing.T) {
	var mu sync.Mutex
	models := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			mu.Lock()
			models++
			mu.Unlock()
			_, _ = io.WriteString(w, `{"data":[]}`)
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{srv.URL + "/v1"}, ProbeInterval: 50 * time.Millisecond})
	waitFor(t, 3*time.Second, "a probe asks /v1/models", func() bool { mu.Lock(); defer mu.Unlock(); return models >= 2 })
	if !set.Up(srv.URL + "/v1") {
		t.Fatal("an engine answering /v1/models left the ring")
	}
}

// fakeResolver answers what the test sets.
type fakeResolver struct {
	mu    sync.Mutex
	addrs []string
}

func (r *fakeResolver) set(addrs ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.addrs = addrs
}

func (r *fakeResolver) LookupHost(_ context.Context, host string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if host != "policy.test" {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return append([]string(nil), r.addrs...), nil
}

func TestEnginesDNS(t *testing.T) {
	// Two engines on one port, as pods behind a headless Service.
	one := newEngineDouble(t, okJSON)
	_, port, _ := net.SplitHostPort(one.srv.Listener.Addr().String())
	ln, err := net.Listen("tcp", "127.0.0.2:"+port)
	if err != nil {
		t.Skipf("127.0.0.2:%s: %v", port, err)
	}
	two := &engineDouble{seen: map[string]int{}}
	two.srv = &httptest.Server{Listener: ln, Config: &http.Server{Handler: one.srv.Config.Handler}}
	two.srv.Start()
	t.Cleanup(two.srv.Close)

	res := &fakeResolver{}
	res.set("127.0.0.1")
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{"dns://policy.test:" + port + "/v1"}, Resolver: res, ResolveInterval: 20 * time.Millisecond})
	url1, url2 := "http://127.0.0.1:"+port+"/v1", "http://127.0.0.2:"+port+"/v1"
	same := func(want ...string) func() bool {
		return func() bool { return fmt.Sprint(set.URLs()) == fmt.Sprint(want) }
	}
	waitFor(t, 3*time.Second, "the first lookup", same(url1))
	res.set("127.0.0.2", "127.0.0.1")
	waitFor(t, 3*time.Second, "a pod that joins", same(url1, url2))

	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{}), Engines: set})
	got := map[string]bool{}
	for s := range 40 {
		resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", strconv.Itoa(s))+"/chat/completions", chatBody, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		got[h.next(t).Engine] = true
	}
	if !got[url1] || !got[url2] {
		t.Fatalf("calls reached %v, want both pods", got)
	}

	res.set("127.0.0.2")
	waitFor(t, 3*time.Second, "a pod that leaves", same(url2))
	// A failed lookup keeps the engines.
	res.set()
	time.Sleep(100 * time.Millisecond) // several lookups, none of which may empty the set
	if !same(url2)() {
		t.Fatalf("after failed lookups the engines are %v", set.URLs())
	}
}

func TestEnginesStreamCutAfterBytes(t *testing.T) {
	cut := newEngineDouble(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: "+toolStream[1]+"\n\n")
		w.(http.Flusher).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	})
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{cut.base, newEngineDouble(t, okJSON).base}, ProbeInterval: time.Hour})
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{}), Engines: set, Retry: llmproxy.RetryPolicy{MaxRetries: 2}})
	for s := 0; ; s++ {
		if s == 20 {
			t.Fatal("no sample's stream went to the engine that cuts")
		}
		resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", strconv.Itoa(s))+"/chat/completions", streamBody, nil)
		c := h.next(t)
		if len(c.UpstreamAttempts) == 0 || c.UpstreamAttempts[0].Engine != cut.base {
			continue
		}
		// The client had bytes: no second attempt, a typed error.
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "Let me") {
			t.Fatalf("the client got %d %q", resp.StatusCode, body)
		}
		if c.Attempts != 1 || len(c.UpstreamAttempts) != 1 || !strings.Contains(c.Error, "stream broke") {
			t.Fatalf("a cut stream: attempts %d %+v, error %q", c.Attempts, c.UpstreamAttempts, c.Error)
		}
		return
	}
}

func TestEnginesWireURLWinsUnlessOwned(t *testing.T) {
	wire := newUpstream(t, okJSON)
	engine := newEngineDouble(t, okJSON)
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{engine.base}})
	for _, owns := range []bool{false, true} {
		h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: wire.base}), Engines: set, EnginesOwnRouting: owns})
		resp, body := post(t, h.url+"/v1/chat/completions", chatBody, ids)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		c := h.next(t)
		want := ""
		if owns {
			want = engine.base
		}
		if c.Engine != want {
			t.Fatalf("owns routing %v: engine %q, want %q", owns, c.Engine, want)
		}
	}
	if n := len(wire.requests()); n != 1 {
		t.Fatalf("the wire's URL got %d calls, want 1", n)
	}
	if n := len(engine.sessions()); n != 1 {
		t.Fatalf("the engine got %d sessions, want 1", n)
	}
}

func TestNewEnginesRejectsBadConfig(t *testing.T) {
	for _, cfg := range []llmproxy.EnginesConfig{
		{},
		{URLs: []string{"vllm:8000"}},
		{URLs: []string{"dns://name/v1"}},
		{URLs: []string{"http://a/v1"}, LoadFactor: 0.5},
		{URLs: []string{"http://a/v1"}, ProbeInterval: -1},
	} {
		if _, err := llmproxy.NewEngines(cfg); err == nil || !strings.Contains(err.Error(), "EnginesConfig") {
			t.Errorf("NewEngines(%+v) = %v, want an error naming the field", cfg, err)
		}
	}
}

// The engines' metrics count calls, failures and affinity per engine, and
// the chat span names the engine that answered and the one that failed.
func TestEnginesMetricsAndSpans(t *testing.T) {
	sick := newEngineDouble(t, func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "sick", http.StatusInternalServerError)
	})
	good := newEngineDouble(t, okJSON)
	reg := prometheus.NewPedanticRegistry()
	set := runEngines(t, llmproxy.EnginesConfig{URLs: []string{sick.base, good.base}, ProbeInterval: time.Hour, FailThreshold: 100, Metrics: reg})
	h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{}), Engines: set, Retry: llmproxy.RetryPolicy{MaxRetries: 1}})
	failedOver := ""
	for s := range 10 {
		exp.Reset()
		for range 2 {
			resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", strconv.Itoa(s))+"/chat/completions", chatBody, nil)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			h.next(t)
		}
		span := exp.GetSpans()[0]
		if got := attrs(span)[osmoattr.Engine].AsString(); got != good.base {
			t.Fatalf("span's engine %q, want %q", got, good.base)
		}
		for _, ev := range span.Events {
			for _, kv := range ev.Attributes {
				if kv.Key == osmoattr.Engine {
					failedOver = kv.Value.AsString()
				}
			}
		}
	}
	if failedOver != sick.base {
		t.Fatalf("no retry event named the sick engine (got %q)", failedOver)
	}
	value := func(name string, labels map[string]string) float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
		metric:
			for _, m := range mf.GetMetric() {
				for _, lp := range m.GetLabel() {
					if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
						continue metric
					}
				}
				if m.GetCounter() != nil {
					return m.GetCounter().GetValue()
				}
				return m.GetGauge().GetValue()
			}
		}
		return -1
	}
	sickCalls := value("osmo_llmproxy_engine_calls_total", map[string]string{"engine": sick.base})
	if sickCalls < 1 || value("osmo_llmproxy_engine_failures_total", map[string]string{"engine": sick.base, "reason": "http_5xx"}) != sickCalls {
		t.Errorf("the sick engine: %v calls, %v failures", sickCalls, value("osmo_llmproxy_engine_failures_total", map[string]string{"engine": sick.base, "reason": "http_5xx"}))
	}
	if n := value("osmo_llmproxy_engine_calls_total", map[string]string{"engine": good.base}); n != 20 {
		t.Errorf("the good engine answered %v calls, want 20", n)
	}
	if n := value("osmo_llmproxy_engine_in_flight", map[string]string{"engine": good.base}); n != 0 {
		t.Errorf("%v calls in flight after the last", n)
	}
	if up := value("osmo_llmproxy_engine_up", map[string]string{"engine": sick.base}); up != 1 {
		t.Errorf("the sick engine's up gauge %v, want 1 below its fail threshold", up)
	}
	// A sample whose first call failed over stays on the engine that
	// answered it: every call is a hit.
	if hit, miss := value("osmo_llmproxy_affinity_calls_total", map[string]string{"result": "hit"}), value("osmo_llmproxy_affinity_calls_total", map[string]string{"result": "miss"}); hit != 20 || miss > 0 {
		t.Errorf("affinity hits %v, misses %v", hit, miss)
	}
}

// budgetProxy is a proxy over two engines that both serve chat, with one
// retry per call and one retry in flight at most (the budget's minimum).
// chat is given each call's session and how many calls of that session
// came so far, this one counted. A call that runs hold signals blocked
// and waits for open, which the test calls, or else its cleanup before
// the servers' Close waits for the held handler (cleanups run last
// first), so a failing test cannot hang.
func budgetProxy(t *testing.T, chat func(w http.ResponseWriter, r *http.Request, sess string, n int, hold func())) (h *harness, blocked <-chan struct{}, open func()) {
	t.Helper()
	held := make(chan struct{}, 1)
	release := make(chan struct{})
	var once sync.Once
	open = func() { once.Do(func() { close(release) }) }
	hold := func() {
		held <- struct{}{}
		<-release
	}
	var mu sync.Mutex
	seen := map[string]int{}
	handler := func(w http.ResponseWriter, r *http.Request) {
		sess := r.Header.Get(llmproxy.HeaderSessionID)
		mu.Lock()
		seen[sess]++
		n := seen[sess]
		mu.Unlock()
		chat(w, r, sess, n, hold)
	}
	set := runEngines(t, llmproxy.EnginesConfig{
		URLs:          []string{newEngineDouble(t, handler).base, newEngineDouble(t, handler).base},
		ProbeInterval: time.Hour, FailThreshold: 100, RetryBudget: 0.01, MinRetries: 1,
	})
	h = newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{}), Engines: set, Retry: llmproxy.RetryPolicy{MaxRetries: 1}})
	t.Cleanup(open)
	return h, held, open
}

// When retries in flight reach the budget, a failed call is not retried:
// it fails with its error, which says why.
func TestEnginesRetryBudget(t *testing.T) {
	h, blocked, open := budgetProxy(t, func(w http.ResponseWriter, _ *http.Request, sess string, n int, hold func()) {
		if sess == "r/a" && n == 2 {
			// Sample a's retry holds the one retry the budget allows.
			hold()
		}
		http.Error(w, "sick", http.StatusServiceUnavailable)
	})
	done := make(chan int, 1)
	go func() {
		resp, _ := post(t, h.url+llmproxy.BaseURLFor("", "r", "a")+"/chat/completions", chatBody, nil)
		done <- resp.StatusCode
	}()
	<-blocked
	resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", "b")+"/chat/completions", chatBody, nil)
	e := decodeError(t, resp, body, http.StatusBadGateway)
	if !strings.Contains(e.Error.Message, "retry budget") {
		t.Fatalf("message %q does not name the retry budget", e.Error.Message)
	}
	if c := h.next(t); c.Attempts != 1 || len(c.UpstreamAttempts) != 1 {
		t.Fatalf("sample b: %d attempts %+v, want one", c.Attempts, c.UpstreamAttempts)
	}
	open()
	if code := <-done; code != http.StatusBadGateway {
		t.Fatalf("sample a: status %d", code)
	}
	if c := h.next(t); c.Attempts != 2 || len(c.UpstreamAttempts) != 2 || c.UpstreamAttempts[0].Engine == c.UpstreamAttempts[1].Engine {
		t.Fatalf("sample a: %d attempts %+v, want two on two engines", c.Attempts, c.UpstreamAttempts)
	}
	// The budget is given back: b is retried now.
	resp, _ = post(t, h.url+llmproxy.BaseURLFor("", "r", "b")+"/chat/completions", chatBody, nil)
	if c := h.next(t); resp.StatusCode != http.StatusBadGateway || c.Attempts != 2 {
		t.Fatalf("sample b again: status %d, %d attempts", resp.StatusCode, c.Attempts)
	}
}

// TestBrokenConnectionRetryIsNotBudgeted: with the one budgeted retry
// taken (a 503 retried, its second attempt held), a call whose engine cut
// its connection still goes to another engine: a dying engine cuts all
// its calls at once, and moving them adds no load.
func TestBrokenConnectionRetryIsNotBudgeted(t *testing.T) {
	h, blocked, open := budgetProxy(t, func(w http.ResponseWriter, r *http.Request, sess string, n int, hold func()) {
		switch {
		case sess == "r/cut" && n == 1:
			hijackClose(t, w)
		case sess == "r/cut":
			okJSON(w, r)
		case n == 2:
			hold()
			fallthrough
		default:
			http.Error(w, "sick", http.StatusServiceUnavailable)
		}
	})
	done := make(chan int, 1)
	go func() {
		resp, _ := post(t, h.url+llmproxy.BaseURLFor("", "r", "sick")+"/chat/completions", chatBody, nil)
		done <- resp.StatusCode
	}()
	<-blocked
	resp, body := post(t, h.url+llmproxy.BaseURLFor("", "r", "cut")+"/chat/completions", chatBody, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the cut call: %d %s, want it moved and answered", resp.StatusCode, body)
	}
	if c := h.next(t); c.Attempts != 2 || len(c.UpstreamAttempts) != 2 || c.UpstreamAttempts[0].Engine == c.UpstreamAttempts[1].Engine {
		t.Fatalf("the cut call: %d attempts %+v, want two on two engines", c.Attempts, c.UpstreamAttempts)
	}
	open()
	if code := <-done; code != http.StatusBadGateway {
		t.Fatalf("the sick call: status %d", code)
	}
}
