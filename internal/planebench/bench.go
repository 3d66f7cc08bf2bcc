// Package planebench measures the policy plane: the proxy in front of a set
// of inference engines. It compares the plane with 1 and 8 engines against
// the single-upstream proxy (added p99, requests per second), measures
// affinity and balance under a skewed load of long and short samples, and
// kills an engine in the middle of a run of rollouts to count what was
// lost or answered twice. `osmo bench plane` prints it.
//
// Engines are mockllm servers on loopback, each behind a counter that sees
// every call the proxy sends it; everything runs in this process.
package planebench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// PlaneFunc builds the proxy over a set of engines (OpenAI base URLs
// ending in /v1) that sends its calls upstream through tr and records
// every call with rec; what it starts (probes) lasts until ctx ends.
type PlaneFunc func(ctx context.Context, engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (Plane, error)

// Plane is the proxy a PlaneFunc builds.
type Plane struct {
	http.Handler
	// Ended, when set, is told that a rollout's samples made their last
	// call, as the rollout service tells its engine set when a rollout
	// ends (llmproxy.Engines.Forget).
	Ended func(rolloutID string)
}

// dropCalls is the recorder of the latency runs.
var dropCalls = llmproxy.RecorderFunc(func(context.Context, *osmo.LLMCall) {})

// Config sizes the runs. Zero fields take the defaults shown.
type Config struct {
	// Requests per setup in the latency runs (40,000: a p99 of fewer
	// moves by more than the plane adds on a machine this size).
	Requests int
	// Clients sending at once in the latency runs (1: the time the plane
	// adds to a call). With clients enough to keep the machine's cores
	// busy (the engines and agents run beside the proxy), the p99 is the
	// run queue's wait and the collector's pauses, which differ between
	// runs by more than the plane adds.
	Clients int
	// Samples in the skewed run (4,000), played by SkewClients agents at
	// once (64), in rollouts of 4: one sample in ten is long (LongCalls
	// calls, 24), the others short (2 calls). The run's end, when only
	// long samples are left on the engines they started on, weighs less
	// the more samples there are.
	Samples     int
	SkewClients int
	LongCalls   int
	// Rollouts in the kill run (2,000), on KillEngines engines (4), one of
	// which dies half way through its share of the calls.
	Rollouts    int
	KillEngines int
	// Plane builds the proxy over several engines (nil: the plane is not
	// measured, only the single-upstream proxy).
	Plane PlaneFunc
}

// Defaults is the configuration of a run with every field at its default.
func Defaults() Config { return Config{}.withDefaults() }

func (c Config) withDefaults() Config {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.Requests, 40_000)
	def(&c.Clients, 1)
	def(&c.Samples, 4000)
	def(&c.SkewClients, 64)
	def(&c.LongCalls, 24)
	def(&c.Rollouts, 2000)
	def(&c.KillEngines, 4)
	return c
}

// Setup is one latency run: Clients sending Requests through a setup.
type Setup struct {
	Name    string
	Engines int
	P50     time.Duration
	P99     time.Duration
	// PerSecond is requests answered per second of the run.
	PerSecond float64
	// Skipped says why the setup was not measured ("" when it was).
	Skipped string
}

// Balance is the skewed run: long and short samples on several engines.
type Balance struct {
	Engines, Samples, Calls int
	// Affinity is the fraction of calls that went to their sample's
	// most used engine: 1 when every sample stayed on one engine.
	Affinity float64
	// MaxMean is the busiest engine's calls over the mean engine's.
	MaxMean float64
	Skipped string
}

// Kill is the run with an engine killed part way.
type Kill struct {
	Engines, Rollouts, Calls int
	// Lost counts the rollouts that did not finish: one of their calls got
	// no answer (or an error) however the proxy retried.
	Lost int
	// Twice counts the calls answered twice: a sample whose agent got k
	// answers and whose record holds k+1 answered calls counts 1.
	Twice int
	// Unsent counts answers engines produced that never reached an agent:
	// those the killed engine had not finished sending (the plane sent the
	// call again). They cost engine time, not correctness.
	Unsent int
	// Cut counts the calls the killed engine cut without an answer (the
	// plane sent them again, or they were lost).
	Cut     int
	Skipped string
}

// Report is everything `osmo bench plane` prints.
type Report struct {
	// Direct is the engine called without a proxy; Single the proxy with
	// one upstream; Plane1 and Plane8 the plane with 1 and 8 engines.
	Direct, Single, Plane1, Plane8 Setup
	Balance                        Balance
	Kill                           Kill
	GOMAXPROCS                     int
}

// AddedP99 is what a setup adds to the direct call's p99.
func (r Report) AddedP99(s Setup) time.Duration { return s.P99 - r.Direct.P99 }

// AddedP99Ratio is the plane's (8 engines) added p99 over the single
// upstream proxy's; 0 when either was not measured. The target is 1.2 or
// less.
func (r Report) AddedP99Ratio() float64 {
	single := r.AddedP99(r.Single)
	if r.Plane8.Skipped != "" || r.Single.Skipped != "" || single <= 0 {
		return 0
	}
	return float64(r.AddedP99(r.Plane8)) / float64(single)
}

// Measure runs the three parts; ctx bounds them.
func Measure(ctx context.Context, cfg Config) (Report, error) {
	cfg = cfg.withDefaults()
	rep := Report{GOMAXPROCS: runtime.GOMAXPROCS(0)}
	var err error
	if rep.Direct, rep.Single, rep.Plane1, rep.Plane8, err = measureLatency(ctx, cfg); err != nil {
		return rep, err
	}
	if rep.Balance, err = measureBalance(ctx, cfg); err != nil {
		return rep, err
	}
	if rep.Kill, err = measureKill(ctx, cfg); err != nil {
		return rep, err
	}
	return rep, nil
}

// fleet is a set of engines on loopback, each counting what it answers.
type fleet struct {
	engines []*engine
}

type engine struct {
	url  string
	mock *mockllm.Server
	srv  *http.Server
	mu   sync.Mutex
	// answered counts the complete 200 answers per sample (rollout id and
	// sample id, as the proxy forwards them).
	answered map[string]int
	calls    int
}

func (e *engine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !strings.HasSuffix(r.URL.Path, "/chat/completions") {
		e.mock.ServeHTTP(w, r)
		return
	}
	rec := &statusWriter{ResponseWriter: w}
	e.mock.ServeHTTP(rec, r) // a dying engine panics out of here: nothing counted
	if rec.status != http.StatusOK {
		return
	}
	key := r.Header.Get(llmproxy.HeaderRolloutID) + "/" + r.Header.Get(llmproxy.HeaderSampleID)
	e.mu.Lock()
	e.answered[key]++
	e.calls++
	e.mu.Unlock()
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// startFleet starts n engines; opts[i] (when given) configures engine i.
func startFleet(n int, opts map[int]mockllm.Options) (*fleet, error) {
	f := &fleet{}
	for i := range n {
		o := opts[i]
		o.EngineID = fmt.Sprintf("e%d", i)
		m, err := mockllm.New(o)
		if err != nil {
			f.close()
			return nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			f.close()
			return nil, err
		}
		e := &engine{url: "http://" + ln.Addr().String() + "/v1", mock: m, answered: map[string]int{}}
		e.srv = &http.Server{Handler: e, ReadHeaderTimeout: 10 * time.Second}
		f.engines = append(f.engines, e)
		go func() { _ = e.srv.Serve(ln) }()
		go func() {
			// A dead engine's port closes, and its connections with it.
			<-m.Dead()
			_ = e.srv.Close()
		}()
	}
	return f, nil
}

func (f *fleet) urls() []string {
	out := make([]string, len(f.engines))
	for i, e := range f.engines {
		out[i] = e.url
	}
	return out
}

func (f *fleet) close() {
	for _, e := range f.engines {
		_ = e.srv.Close()
	}
}

// singleProxy is the proxy as it is without an engine set: one upstream.
func singleProxy(_ context.Context, engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (Plane, error) {
	if len(engines) != 1 {
		return Plane{}, fmt.Errorf("the single-upstream proxy takes 1 engine, got %d", len(engines))
	}
	p, err := llmproxy.New(llmproxy.Config{
		Router:    llmproxy.StaticRouter(llmproxy.Route{BaseURL: engines[0], Model: "bench-policy"}),
		Recorder:  rec,
		Transport: tr,
	})
	return Plane{Handler: p}, err
}

// serve serves h on loopback until the returned stop is called.
func serve(h http.Handler) (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String(), func() { _ = srv.Close() }, nil
}

// agent is the client side: it sends chat calls as one sample of one
// rollout and reads whole answers.
type agent struct {
	client *http.Client
	// answered, when set, is told the rollout/sample of every call
	// answered 200 in full.
	answered func(key string)
}

func newAgent(clients int) *agent {
	return &agent{client: &http.Client{
		Transport: &http.Transport{MaxIdleConnsPerHost: clients, DisableCompression: true},
		Timeout:   30 * time.Second,
	}}
}

func (a *agent) call(ctx context.Context, target, rollout, sample string, turn int) error {
	body := fmt.Sprintf(`{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"What is %d times 7?"}],"max_tokens":16}`, turn+2)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(llmproxy.HeaderRolloutID, rollout)
	req.Header.Set(llmproxy.HeaderSampleID, sample)
	resp, err := a.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("answered %d", resp.StatusCode)
	}
	if a.answered != nil {
		a.answered(rollout + "/" + sample)
	}
	return nil
}

// latencyRun sends n calls from clients goroutines to target and returns
// their latencies and the run's length.
func (a *agent) latencyRun(ctx context.Context, target string, clients, n int) ([]time.Duration, time.Duration, error) {
	lat := make([]time.Duration, n)
	next := make(chan int)
	errc := make(chan error, clients)
	var wg sync.WaitGroup
	start := time.Now()
	for range clients {
		wg.Go(func() {
			for i := range next {
				t0 := time.Now()
				if err := a.call(ctx, target, "bench", fmt.Sprintf("s%d", i%64), i%4); err != nil {
					errc <- err
					return
				}
				lat[i] = time.Since(t0)
			}
		})
	}
	var err error
feed:
	for i := range n {
		select {
		case next <- i:
		case err = <-errc:
			break feed
		case <-ctx.Done():
			err = ctx.Err()
			break feed
		}
	}
	close(next)
	wg.Wait()
	if err == nil && len(errc) > 0 {
		err = <-errc
	}
	return lat, time.Since(start), err
}

func percentile(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := (len(sorted)*p + 99) / 100
	return sorted[max(i-1, 0)]
}

// measureLatency runs direct, single, plane 1 and plane 8 in interleaved
// rounds, so drifts in the machine's load hit them alike.
func measureLatency(ctx context.Context, cfg Config) (direct, single, plane1, plane8 Setup, err error) {
	direct, single = Setup{Name: "direct", Engines: 1}, Setup{Name: "single upstream", Engines: 1}
	plane1, plane8 = Setup{Name: "plane", Engines: 1}, Setup{Name: "plane", Engines: 8}
	f, err := startFleet(8, nil)
	if err != nil {
		return
	}
	defer f.close()
	tr := llmproxy.DefaultTransport()
	defer tr.CloseIdleConnections()
	type run struct {
		s      *Setup
		target string
		lat    []time.Duration
		took   time.Duration
	}
	runs := []*run{{s: &direct, target: f.engines[0].url + "/chat/completions"}}
	var stops []func()
	build := func(s *Setup, plane PlaneFunc, engines []string) error {
		if plane == nil {
			s.Skipped = "no engine set to measure"
			return nil
		}
		pctx, pcancel := context.WithCancel(ctx)
		stops = append(stops, pcancel)
		// Each latency run is one long rollout: Ended is not called.
		h, err := plane(pctx, engines, tr, dropCalls)
		if err != nil {
			return fmt.Errorf("planebench: building %s with %d engines: %w", s.Name, len(engines), err)
		}
		u, stop, err := serve(h)
		if err != nil {
			return err
		}
		stops = append(stops, stop)
		runs = append(runs, &run{s: s, target: u + "/v1/chat/completions"})
		return nil
	}
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	for _, b := range []struct {
		s       *Setup
		plane   PlaneFunc
		engines []string
	}{{&single, singleProxy, f.urls()[:1]}, {&plane1, cfg.Plane, f.urls()[:1]}, {&plane8, cfg.Plane, f.urls()}} {
		if err = build(b.s, b.plane, b.engines); err != nil {
			return
		}
	}
	a := newAgent(cfg.Clients)
	defer a.client.CloseIdleConnections()
	// Warm connections and code paths.
	for _, r := range runs {
		if _, _, err = a.latencyRun(ctx, r.target, cfg.Clients, min(cfg.Requests, 200)); err != nil {
			err = fmt.Errorf("planebench: warming %s: %w", r.s.Name, err)
			return
		}
	}
	const rounds = 10
	per := max(cfg.Requests/rounds, 1)
	for i := range rounds {
		for j := range runs {
			r := runs[(i+j)%len(runs)]
			lat, took, e := a.latencyRun(ctx, r.target, cfg.Clients, per)
			if e != nil {
				err = fmt.Errorf("planebench: %s with %d engines: %w", r.s.Name, r.s.Engines, e)
				return
			}
			r.lat, r.took = append(r.lat, lat...), r.took+took
		}
	}
	for _, r := range runs {
		slices.Sort(r.lat)
		r.s.P50, r.s.P99 = percentile(r.lat, 50), percentile(r.lat, 99)
		r.s.PerSecond = float64(len(r.lat)) / r.took.Seconds()
	}
	return
}
