package llmproxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/osmo-rl/osmo"
)

// Defaults for the zero values of EnginesConfig.
const (
	DefaultLoadFactor       = 1.25
	DefaultProbeInterval    = time.Second
	DefaultProbeTimeout     = time.Second
	DefaultProbeMaxInterval = 30 * time.Second
	DefaultFailThreshold    = 3
	DefaultResolveInterval  = 5 * time.Second
	DefaultMaxSamples       = 100_000
	DefaultLinger           = time.Second
	DefaultRetryBudget      = 0.2
	DefaultMinRetries       = 3
)

// HeaderSessionID names the header every call routed to an engine carries:
// one value per sample, which engines' own routers (vLLM's, SGLang's) read
// to keep a conversation on one replica.
const HeaderSessionID = "X-Session-ID"

// virtualNodes is how many points each engine has on the ring: enough for
// the engines' shares of the hash space to differ by a few percent.
const virtualNodes = 160

// Resolver looks up the addresses of a DNS name; *net.Resolver is one.
type Resolver interface {
	LookupHost(ctx context.Context, host string) ([]string, error)
}

// EnginesConfig configures a set of policy engines.
type EnginesConfig struct {
	// URLs are the engines: OpenAI base URLs such as http://vllm-0:8000/v1,
	// or dns://NAME:PORT/PATH, a DNS name each of whose addresses is an
	// engine at http://ADDRESS:PORT/PATH (a Kubernetes headless Service),
	// looked up again every ResolveInterval. At least one.
	URLs []string
	// LoadFactor is c of consistent hashing with bounded loads: no engine
	// takes a call while it holds c × the mean of calls in flight or more;
	// the call goes to the next engine on the ring. At least 1; 0 means
	// DefaultLoadFactor.
	LoadFactor float64
	// ProbeInterval is the time between health probes of an engine that is
	// up (GET /health at the server's root answering 2xx; where that is a
	// 404, GET {base}/models answering anything but a 5xx);
	// ProbeTimeout bounds one probe. An engine that fails a probe leaves the
	// ring at once and is probed back with exponential backoff from
	// ProbeInterval up to ProbeMaxInterval.
	ProbeInterval    time.Duration
	ProbeTimeout     time.Duration
	ProbeMaxInterval time.Duration
	// FailThreshold is how many calls in a row may fail on an engine (a
	// 5xx, a timeout, a broken connection) before it leaves the ring; a
	// refused connection takes it out at once. 0 means DefaultFailThreshold.
	FailThreshold int
	// Timeout bounds one attempt on an engine as Config.Timeout does
	// (the wait for an answer, or for each piece of a stream); 0 means
	// the proxy's Config.Timeout.
	Timeout time.Duration
	// RetryBudget bounds the retries in flight over the engines to this
	// fraction of the calls in flight (at least MinRetries at once): when
	// engines fail together (5xx answers, timeouts), calls fail with their
	// error instead of multiplying the load. A retry after a broken
	// connection (refused, reset, cut), or away from an engine that has
	// left the ring (dead, hung past a probe), only moves load, and is not
	// counted. 0 means DefaultRetryBudget.
	RetryBudget float64
	// MinRetries is how many retries may be in flight whatever the
	// budget; 0 means DefaultMinRetries.
	MinRetries int
	// MaxSamples bounds how many samples the set remembers the engine of
	// (the least recently seen are forgotten); 0 means DefaultMaxSamples.
	MaxSamples int
	// Linger is how long a sample's slot stays counted in its engine's
	// load after its call answered: an agent between two calls (running a
	// tool, say) still holds its prefix in the engine's cache, and its
	// next call takes the slot over, whatever the bound, instead of
	// competing for one, so the bound moves samples when engines are
	// overloaded rather than when a sample happens to be between calls.
	// Forget gives an ended rollout's slots back before Linger. 0 means
	// DefaultLinger; negative counts calls in flight only.
	Linger time.Duration
	// ResolveInterval is the time between lookups of dns:// engines.
	ResolveInterval time.Duration
	// Resolver looks up dns:// names; nil means net.DefaultResolver.
	Resolver Resolver
	// Transport carries the probes; nil means DefaultTransport().
	Transport http.RoundTripper
	// Metrics, when set, receives the per-engine collectors
	// (osmo_llmproxy_engine_*, osmo_llmproxy_affinity_*).
	Metrics prometheus.Registerer
	// Logger receives engines leaving and joining the ring.
	Logger *slog.Logger
}

// Engines is a set of policy engines behind the proxy: calls are spread
// over them by consistent hashing of the rollout and sample ids with
// bounded loads, engines are probed and watched, and a failed engine's
// calls go to the next one. Run drives the probes and DNS lookups.
type Engines struct {
	cfg     EnginesConfig
	static  []string
	dns     []dnsSource
	log     *slog.Logger
	metrics *engineMetrics

	mu      sync.Mutex // guards engines, ring, dnsSeen, run, and the picks
	engines map[string]*engine
	ring    []point // sorted by hash
	dnsSeen map[string][]string
	run     context.Context // set while Run runs
	wg      sync.WaitGroup

	// calls and retries are in flight over the engines (the retry budget).
	calls, retries atomic.Int64

	// samples remembers where each sample's calls went, so its next call
	// goes to the engine holding its prefix even after a move; rollouts
	// lists the keys of each rollout's samples there, for Forget.
	samples  *lru.Cache[string, placement]
	rollouts map[string][]string
}

// placement is where a sample's calls went: the engine of its first
// call (the affinity metric's reference) and of its last answered one,
// and the slot it holds there until linger ends.
type placement struct {
	rollout     string
	first, last string
	held        *engine
	timer       *time.Timer
}

// drop gives the held slot back. Engines.mu is held: a timer that fired
// and waits for it finds its slot gone and leaves the load alone.
func (pl *placement) drop() {
	if pl.held != nil {
		pl.timer.Stop()
		pl.held.inFlight.Add(-1)
	}
	pl.held, pl.timer = nil, nil
}

type dnsSource struct {
	raw, host, port, path string
}

type point struct {
	hash uint64
	e    *engine
}

// engine is one policy engine.
type engine struct {
	url      string // OpenAI base URL, without a trailing slash
	health   string // GET URL of its health endpoint
	models   string // GET URL of its models endpoint
	inFlight atomic.Int64
	up       atomic.Bool
	fails    atomic.Int32 // calls failed in a row
	removed  atomic.Bool  // DNS no longer names it: its series are gone
	stop     context.CancelFunc
	wake     chan struct{} // a passive mark asks the prober to look now

	// left ends when the engine leaves the ring, and is made anew when it
	// comes back: attempts waiting on it for an answer go elsewhere.
	mu    sync.Mutex
	left  context.Context
	leave context.CancelFunc
}

// leaving ends once the engine leaves the ring (now, if it is out).
func (e *engine) leaving() context.Context {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.left
}

// NewEngines validates cfg and returns the set; its engines are up until
// a probe or a call says otherwise. dns:// engines join when Run first
// looks them up.
func NewEngines(cfg EnginesConfig) (*Engines, error) {
	switch {
	case len(cfg.URLs) == 0:
		return nil, errors.New("llmproxy.NewEngines: EnginesConfig.URLs: at least one engine is required")
	case cfg.LoadFactor != 0 && (cfg.LoadFactor < 1 || math.IsNaN(cfg.LoadFactor) || math.IsInf(cfg.LoadFactor, 0)):
		return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.LoadFactor must be at least 1, got %v", cfg.LoadFactor)
	case cfg.ProbeInterval < 0 || cfg.ProbeTimeout < 0 || cfg.ProbeMaxInterval < 0 || cfg.ResolveInterval < 0:
		return nil, errors.New("llmproxy.NewEngines: EnginesConfig intervals must not be negative")
	case cfg.Timeout < 0:
		return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.Timeout must not be negative, got %s", cfg.Timeout)
	case cfg.RetryBudget < 0 || math.IsNaN(cfg.RetryBudget) || math.IsInf(cfg.RetryBudget, 0):
		return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.RetryBudget must be a fraction of 0 or more, got %v", cfg.RetryBudget)
	case cfg.MinRetries < 0:
		return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.MinRetries must not be negative, got %d", cfg.MinRetries)
	case cfg.MaxSamples < 0:
		return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.MaxSamples must not be negative, got %d", cfg.MaxSamples)
	case cfg.FailThreshold < 0:
		return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.FailThreshold must not be negative, got %d", cfg.FailThreshold)
	}
	cfg.LoadFactor = cmp.Or(cfg.LoadFactor, DefaultLoadFactor)
	cfg.ProbeInterval = cmp.Or(cfg.ProbeInterval, DefaultProbeInterval)
	cfg.ProbeTimeout = cmp.Or(cfg.ProbeTimeout, DefaultProbeTimeout)
	cfg.ProbeMaxInterval = cmp.Or(cfg.ProbeMaxInterval, DefaultProbeMaxInterval)
	cfg.ProbeMaxInterval = max(cfg.ProbeMaxInterval, cfg.ProbeInterval)
	cfg.FailThreshold = cmp.Or(cfg.FailThreshold, DefaultFailThreshold)
	cfg.RetryBudget = cmp.Or(cfg.RetryBudget, DefaultRetryBudget)
	cfg.MinRetries = cmp.Or(cfg.MinRetries, DefaultMinRetries)
	cfg.Linger = cmp.Or(cfg.Linger, DefaultLinger)
	cfg.MaxSamples = cmp.Or(cfg.MaxSamples, DefaultMaxSamples)
	cfg.ResolveInterval = cmp.Or(cfg.ResolveInterval, DefaultResolveInterval)
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.Transport == nil {
		cfg.Transport = DefaultTransport()
	}
	s := &Engines{cfg: cfg, log: cfg.Logger, engines: map[string]*engine{}, dnsSeen: map[string][]string{}, rollouts: map[string][]string{}}
	// A sample forgotten gives its held slot back. The cache is only
	// used under s.mu, so its callback is too.
	samples, err := lru.NewWithEvict(cfg.MaxSamples, func(key string, pl placement) {
		pl.drop()
		keys := slices.DeleteFunc(s.rollouts[pl.rollout], func(k string) bool { return k == key })
		if len(keys) == 0 {
			delete(s.rollouts, pl.rollout)
		} else {
			s.rollouts[pl.rollout] = keys
		}
	})
	if err != nil {
		return nil, fmt.Errorf("llmproxy.NewEngines: %w", err)
	}
	s.samples = samples
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	for i, raw := range cfg.URLs {
		if strings.HasPrefix(raw, "dns://") {
			src, err := parseDNS(raw)
			if err != nil {
				return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.URLs[%d]: %w", i, err)
			}
			s.dns = append(s.dns, src)
			continue
		}
		if err := checkBaseURL(raw); err != nil {
			return nil, fmt.Errorf("llmproxy.NewEngines: EnginesConfig.URLs[%d]: %w", i, err)
		}
		s.static = append(s.static, strings.TrimRight(raw, "/"))
	}
	s.metrics = newEngineMetrics(cfg.Metrics)
	s.mu.Lock()
	s.rebuild()
	s.mu.Unlock()
	return s, nil
}

// checkBaseURL accepts an http(s) URL with a host.
func checkBaseURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("want an http(s) base URL such as http://127.0.0.1:8000/v1 or dns://NAME:PORT/v1, got %q", raw)
	}
	return nil
}

func parseDNS(raw string) (dnsSource, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Hostname() == "" || u.Port() == "" {
		return dnsSource{}, fmt.Errorf("want dns://NAME:PORT/PATH such as dns://vllm-headless:8000/v1, got %q", raw)
	}
	return dnsSource{raw: raw, host: u.Hostname(), port: u.Port(), path: strings.TrimRight(u.EscapedPath(), "/")}, nil
}

// URLs are the base URLs of the engines now known, sorted.
func (s *Engines) URLs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	urls := make([]string, 0, len(s.engines))
	for u := range s.engines {
		urls = append(urls, u)
	}
	slices.Sort(urls)
	return urls
}

// Up reports whether the engine at base URL u is in the ring.
func (s *Engines) Up(u string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.engines[strings.TrimRight(u, "/")]
	return e != nil && e.up.Load()
}

// Load is the load the bound weighs on the engine at base URL u: its calls
// in flight and the slots samples hold there between calls (0 for an
// engine not known).
func (s *Engines) Load(u string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.engines[strings.TrimRight(u, "/")]; e != nil {
		return e.inFlight.Load()
	}
	return 0
}

// rebuild sets the engines to the static ones and those DNS named, keeping
// the state of engines that stay, and rebuilds the ring. s.mu is held.
func (s *Engines) rebuild() {
	want := map[string]bool{}
	for _, u := range s.static {
		want[u] = true
	}
	for _, src := range s.dns {
		for _, addr := range s.dnsSeen[src.raw] {
			want["http://"+net.JoinHostPort(addr, src.port)+src.path] = true
		}
	}
	for u, e := range s.engines {
		if !want[u] {
			if e.stop != nil {
				e.stop()
			}
			delete(s.engines, u)
			e.removed.Store(true)
			s.metrics.forget(u)
			s.log.Info("llmproxy: engine removed", slog.String("engine", u))
		}
	}
	for u := range want {
		if s.engines[u] != nil {
			continue
		}
		e := newEngine(u)
		s.engines[u] = e
		s.metrics.setUp(u, true)
		if s.run != nil {
			s.startProbe(e)
		}
	}
	s.ring = s.ring[:0]
	for u, e := range s.engines {
		for i := range virtualNodes {
			s.ring = append(s.ring, point{hash: xxhash.Sum64String(u + "#" + strconv.Itoa(i)), e: e})
		}
	}
	sort.Slice(s.ring, func(i, j int) bool {
		if s.ring[i].hash != s.ring[j].hash {
			return s.ring[i].hash < s.ring[j].hash
		}
		return s.ring[i].e.url < s.ring[j].e.url
	})
}

func newEngine(base string) *engine {
	e := &engine{url: base, models: base + "/models", wake: make(chan struct{}, 1)}
	e.left, e.leave = context.WithCancel(context.Background())
	root := base
	if u, err := url.Parse(base); err == nil {
		u.Path = strings.TrimSuffix(strings.TrimRight(u.Path, "/"), "/v1")
		u.RawPath = ""
		root = strings.TrimRight(u.String(), "/")
	}
	e.health = root + "/health"
	e.up.Store(true)
	return e
}

// sessionKey is the affinity key of a sample, also sent as X-Session-ID:
// the ids escaped so that no two samples share it.
func sessionKey(rolloutID, sampleID string) string {
	return url.PathEscape(rolloutID) + "/" + url.PathEscape(sampleID)
}

// acquire picks the engine for a call of the sample with this key, never
// one in tried while another is up, and counts the call in its load: the
// engine of the sample's last call while it is up and under the bound,
// else the first under the bound on the sample's path round the ring.
// first is the engine of the sample's first call ("" for a first call).
// e is nil when no engine is known.
func (s *Engines) acquire(key string, tried []*engine) (e *engine, first string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.ring) == 0 {
		return nil, ""
	}
	// The sample's held slot is this call's: on its engine, while that is
	// up and untried, the call takes it over and the engine's load does
	// not change, so the bound cannot move a sample it already counts.
	// Elsewhere, the slot is given up.
	pl, _ := s.samples.Peek(key)
	if e := pl.held; e != nil {
		if e.up.Load() && !slices.Contains(tried, e) {
			pl.timer.Stop()
			pl.held, pl.timer = nil, nil
			s.samples.Add(key, pl)
			s.metrics.sent(e.url)
			return e, pl.first
		}
		pl.drop()
		s.samples.Add(key, pl)
	}
	var total int64
	n := 0
	for _, e := range s.engines {
		if e.up.Load() {
			total += e.inFlight.Load()
			n++
		}
	}
	// The bound of Mirrokni, Thorup and Zadimoghaddam: with this call
	// counted, no engine above ⌈c·m/n⌉.
	limit := int64(math.Ceil(s.cfg.LoadFactor * float64(total+1) / float64(max(n, 1))))
	if last := s.engines[pl.last]; last != nil && last.up.Load() && !slices.Contains(tried, last) && last.inFlight.Load() < limit {
		last.inFlight.Add(1)
		s.metrics.sent(last.url)
		return last, pl.first
	}
	start := searchRing(s.ring, key)
	var (
		free, full, triedUp, downFresh, firstSeen *engine
		// A few engines: a slice beats a map, and allocates nothing
		// while the first ones on the path are free.
		seen [16]*engine
	)
	seenList := seen[:0]
	for i := range s.ring {
		if free != nil || len(seenList) == len(s.engines) {
			break
		}
		c := s.ring[(start+i)%len(s.ring)].e
		if slices.Contains(seenList, c) {
			continue
		}
		seenList = append(seenList, c)
		if firstSeen == nil {
			firstSeen = c
		}
		isTried := slices.Contains(tried, c)
		if !c.up.Load() {
			if !isTried && downFresh == nil {
				downFresh = c
			}
			continue
		}
		switch {
		case isTried:
			if triedUp == nil {
				triedUp = c
			}
		case c.inFlight.Load() < limit:
			if free == nil {
				free = c
			}
		case full == nil:
			full = c
		}
	}
	// Nothing up: an engine not yet tried, so a call still gets its
	// attempts while probes are wrong or every engine restarts.
	e = firstOf(free, full, triedUp, downFresh, firstSeen)
	e.inFlight.Add(1)
	s.metrics.sent(e.url)
	return e, pl.first
}

// answered notes that e answered a call of the rollout's sample with this
// key, whose slot it holds there for Linger; it is ended as release would.
func (s *Engines) answered(rolloutID, key string, e *engine) {
	e.fails.Store(0)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !e.removed.Load() {
		s.metrics.done(e.url)
	}
	pl, known := s.samples.Get(key)
	if !known {
		pl.rollout = rolloutID
		s.rollouts[rolloutID] = append(s.rollouts[rolloutID], key)
	}
	if pl.first == "" {
		pl.first = e.url
	}
	pl.last = e.url
	pl.drop() // a slot from a call of the sample that ran beside this one
	if s.cfg.Linger > 0 {
		var t *time.Timer
		t = time.AfterFunc(s.cfg.Linger, func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if cur, ok := s.samples.Peek(key); ok && cur.timer == t {
				cur.held, cur.timer = nil, nil
				s.samples.Add(key, cur)
				e.inFlight.Add(-1)
			}
		})
		pl.held, pl.timer = e, t
	} else {
		e.inFlight.Add(-1)
	}
	s.samples.Add(key, pl)
}

// Forget is told that a rollout ended: its samples make no more calls, so
// the slots they hold between calls are given back at once instead of
// after Linger, and where they went is forgotten. Without it, samples
// that finished within the last Linger would still count as load, and
// the bound would balance how many samples engines saw rather than the
// calls they answer.
func (s *Engines) Forget(rolloutID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Removing calls the eviction callback, which edits s.rollouts.
	for _, key := range slices.Clone(s.rollouts[rolloutID]) {
		s.samples.Remove(key)
	}
}

// searchRing is the index of key's first point on the ring (mod its length).
func searchRing(ring []point, key string) int {
	h := xxhash.Sum64String(key)
	i := sort.Search(len(ring), func(i int) bool { return ring[i].hash >= h })
	if i == len(ring) {
		i = 0
	}
	return i
}

// firstOf is the first non-nil engine.
func firstOf(es ...*engine) *engine {
	for _, e := range es {
		if e != nil {
			return e
		}
	}
	return nil
}

// beginRetry takes a retry from the budget, or reports that it is spent;
// endRetry gives it back.
func (s *Engines) beginRetry() bool {
	n := s.retries.Add(1)
	if n <= int64(s.cfg.MinRetries) || float64(n) <= s.cfg.RetryBudget*float64(s.calls.Load()) {
		return true
	}
	s.retries.Add(-1)
	return false
}

func (s *Engines) endRetry() { s.retries.Add(-1) }

// hasUntried reports whether an engine up is not in tried, so a failed
// call can go to it at once instead of waiting to try the same one again.
func (s *Engines) hasUntried(tried []*engine) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.engines {
		if e.up.Load() && !slices.Contains(tried, e) {
			return true
		}
	}
	return false
}

// release ends a call's attempt on e; failure is the kind of failure that
// counts against the engine ("" for none, or an answer that says nothing
// of its health), refused whether its connection was refused.
func (s *Engines) release(e *engine, failure string, refused bool) {
	e.inFlight.Add(-1)
	if e.removed.Load() {
		return
	}
	s.metrics.done(e.url)
	if failure == "" {
		e.fails.Store(0)
		return
	}
	s.metrics.failed(e.url, failure)
	if n := e.fails.Add(1); refused || int(n) >= s.cfg.FailThreshold {
		s.markDown(e, failure)
	}
}

// markDown and markUp change up and left together under e.mu: an attempt
// that saw the engine up gets the context of that time in the ring, never
// one already ended.
func (s *Engines) markDown(e *engine, why string) {
	e.mu.Lock()
	wasUp := e.up.Swap(false)
	if wasUp {
		e.leave()
	}
	e.mu.Unlock()
	if wasUp {
		s.metrics.setUp(e.url, false)
		s.log.Warn("llmproxy: engine left the ring", slog.String("engine", e.url), slog.String("reason", why))
	}
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

func (s *Engines) markUp(e *engine) {
	e.fails.Store(0)
	e.mu.Lock()
	wasDown := !e.up.Load()
	if wasDown {
		e.left, e.leave = context.WithCancel(context.Background())
		e.up.Store(true)
	}
	e.mu.Unlock()
	if wasDown {
		s.metrics.setUp(e.url, true)
		s.log.Info("llmproxy: engine back in the ring", slog.String("engine", e.url))
	}
}

// Run probes the engines and looks up dns:// names until ctx ends.
func (s *Engines) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.run != nil {
		s.mu.Unlock()
		return errors.New("llmproxy.Engines.Run: already running")
	}
	s.run = ctx
	for _, e := range s.engines {
		s.startProbe(e)
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.run = nil
		for _, e := range s.engines {
			if e.stop != nil {
				e.stop()
				e.stop = nil
			}
		}
		s.mu.Unlock()
		s.wg.Wait()
	}()
	if len(s.dns) == 0 {
		<-ctx.Done()
		return nil
	}
	t := time.NewTicker(s.cfg.ResolveInterval)
	defer t.Stop()
	for {
		s.resolve(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// resolve looks up every dns:// name; a failed lookup keeps the engines
// the name had.
func (s *Engines) resolve(ctx context.Context) {
	for _, src := range s.dns {
		lctx, cancel := context.WithTimeout(ctx, s.cfg.ResolveInterval)
		addrs, err := s.cfg.Resolver.LookupHost(lctx, src.host)
		cancel()
		if err != nil || len(addrs) == 0 {
			if ctx.Err() == nil {
				s.log.Warn("llmproxy: looking up engines failed; keeping the last ones", slog.String("name", src.raw), slog.Any("error", err))
			}
			continue
		}
		slices.Sort(addrs)
		addrs = slices.Compact(addrs)
		s.mu.Lock()
		if !slices.Equal(s.dnsSeen[src.raw], addrs) {
			s.dnsSeen[src.raw] = addrs
			s.rebuild()
		}
		s.mu.Unlock()
	}
}

// startProbe starts e's prober. s.mu is held and s.run set.
func (s *Engines) startProbe(e *engine) {
	ctx, cancel := context.WithCancel(s.run)
	e.stop = cancel
	s.wg.Go(func() { s.probeLoop(ctx, e) })
}

// probeLoop probes e every ProbeInterval while it is up, and with
// backoff while it is down.
func (s *Engines) probeLoop(ctx context.Context, e *engine) {
	down := backoff.NewExponentialBackOff()
	down.InitialInterval = s.cfg.ProbeInterval
	down.MaxInterval = s.cfg.ProbeMaxInterval
	down.Multiplier = 2
	down.RandomizationFactor = 0.2
	t := time.NewTimer(s.cfg.ProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-e.wake:
			// A passive mark: the next probe is the first of the backoff.
			if !t.Stop() {
				select {
				case <-t.C:
				default:
				}
			}
			down.Reset()
			t.Reset(down.NextBackOff())
			continue
		}
		err := s.probe(ctx, e)
		switch {
		case ctx.Err() != nil:
			return
		case err == nil:
			s.markUp(e)
			down.Reset()
			t.Reset(s.cfg.ProbeInterval)
		default:
			s.metrics.failed(e.url, "probe")
			if e.up.Load() {
				down.Reset()
			}
			s.markDown(e, "probe: "+err.Error())
			// The wake markDown queued is this probe's own.
			select {
			case <-e.wake:
			default:
			}
			t.Reset(down.NextBackOff())
		}
	}
}

// probe asks e's health endpoint, or its models endpoint when it has none
// (a hosted API): there any answer but a 5xx will do, a 401 to a probe
// without the key included, since the server is there to answer.
func (s *Engines) probe(ctx context.Context, e *engine) error {
	status, err := s.get(ctx, e.health)
	switch {
	case err != nil:
		return err
	case status == http.StatusNotFound || status == http.StatusMethodNotAllowed:
		if status, err = s.get(ctx, e.models); err != nil {
			return err
		}
		if status >= 500 {
			return fmt.Errorf("GET %s answered %d", e.models, status)
		}
	case status < 200 || status > 299:
		return fmt.Errorf("GET %s answered %d", e.health, status)
	}
	return nil
}

func (s *Engines) get(ctx context.Context, u string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ProbeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, err
	}
	resp, err := s.cfg.Transport.RoundTrip(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	return resp.StatusCode, nil
}

// engineMetrics are the per-engine collectors; nil when not registered.
type engineMetrics struct {
	calls    *prometheus.CounterVec
	inFlight *prometheus.GaugeVec
	failures *prometheus.CounterVec
	up       *prometheus.GaugeVec
	affinity *prometheus.CounterVec
}

func newEngineMetrics(reg prometheus.Registerer) *engineMetrics {
	if reg == nil {
		return nil
	}
	m := &engineMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llmproxy_engine_calls_total",
			Help: "Upstream attempts sent to each policy engine.",
		}, []string{"engine"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "osmo_llmproxy_engine_in_flight",
			Help: "Upstream attempts in flight on each policy engine (the load consistent hashing bounds).",
		}, []string{"engine"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llmproxy_engine_failures_total",
			Help: "Failures per policy engine: http_5xx, timeout, transport (refused, reset, a stream cut) on calls, probe for a failed health probe.",
		}, []string{"engine", "reason"}),
		up: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "osmo_llmproxy_engine_up",
			Help: "1 while the policy engine is in the ring, 0 while it is out (failed probes or calls).",
		}, []string{"engine"}),
		affinity: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "osmo_llmproxy_affinity_calls_total",
			Help: "Calls routed over the policy engines, by whether the sample's home engine (its first on the ring) answered: hit or miss. The affinity hit rate is hit / (hit + miss).",
		}, []string{"result"}),
	}
	reg.MustRegister(m.calls, m.inFlight, m.failures, m.up, m.affinity)
	return m
}

func (m *engineMetrics) sent(u string) {
	if m != nil {
		m.calls.WithLabelValues(u).Inc()
		m.inFlight.WithLabelValues(u).Inc()
	}
}

func (m *engineMetrics) done(u string) {
	if m != nil {
		m.inFlight.WithLabelValues(u).Dec()
	}
}

func (m *engineMetrics) failed(u, reason string) {
	if m != nil {
		m.failures.WithLabelValues(u, reason).Inc()
	}
}

func (m *engineMetrics) setUp(u string, up bool) {
	if m == nil {
		return
	}
	v := 0.0
	if up {
		v = 1
	}
	m.up.WithLabelValues(u).Set(v)
}

func (m *engineMetrics) routed(hit bool) {
	if m == nil {
		return
	}
	r := "miss"
	if hit {
		r = "hit"
	}
	m.affinity.WithLabelValues(r).Inc()
}

// forget drops the series of an engine DNS no longer names.
func (m *engineMetrics) forget(u string) {
	if m == nil {
		return
	}
	m.calls.DeleteLabelValues(u)
	m.inFlight.DeleteLabelValues(u)
	m.up.DeleteLabelValues(u)
	m.failures.DeletePartialMatch(prometheus.Labels{"engine": u})
}

// pickEngine chooses the engine of the call's next attempt: another than
// those tried while one is up.
func (x *exchange) pickEngine() *engine {
	e, first := x.engines.acquire(x.session, x.tried)
	if len(x.tried) == 0 {
		x.home = first
	}
	return e
}

// engineDone ends an attempt on e: its load, its health, the record.
func (x *exchange) engineDone(ctx context.Context, e *engine, last *upstreamError) {
	failure, refused := "", false
	switch {
	case ctx.Err() != nil:
		// The client left or the rollout ended: nothing about the engine.
	case last != nil:
		switch last.kind {
		case "status":
			failure = attemptHTTP5xx
		case "timeout":
			failure = attemptTimeout
		case "transport":
			failure, refused = attemptTransport, last.refused
		}
	case x.errType == "transport" || x.errType == "timeout":
		// A stream cut after bytes reached the client.
		failure = x.errType
	}
	if last == nil && failure == "" && x.call.StatusCode >= 200 && x.call.StatusCode <= 299 {
		x.engines.answered(x.call.RolloutID, x.session, e)
	} else {
		x.engines.release(e, failure, refused)
	}
	x.tried = append(x.tried, e)
	x.logAttempt(e, last)
	if last == nil {
		x.call.Engine = e.url
	}
}

// logAttempt adds an attempt on e to the record.
func (x *exchange) logAttempt(e *engine, last *upstreamError) {
	if e == nil {
		return
	}
	a := osmo.UpstreamAttempt{Attempt: x.call.Attempts, Engine: e.url}
	if last == nil {
		a.StatusCode, a.Error = x.call.StatusCode, x.call.Error
	} else {
		a.StatusCode, a.Error = last.status, last.Error()
	}
	x.call.UpstreamAttempts = append(x.call.UpstreamAttempts, a)
}

// retryBackOff is the delay schedule of a call's retries: the policy's,
// but none while an engine not yet tried is up, since the failure was
// the engine's and another can answer at once.
func (x *exchange) retryBackOff() backoff.BackOff {
	b := x.p.retry.backOff()
	if x.engines == nil {
		return b
	}
	return &failoverBackOff{inner: b, x: x}
}

type failoverBackOff struct {
	inner backoff.BackOff
	x     *exchange
}

func (b *failoverBackOff) NextBackOff() time.Duration {
	if b.x.engines.hasUntried(b.x.tried) {
		return 0
	}
	return b.inner.NextBackOff()
}

func (b *failoverBackOff) Reset() { b.inner.Reset() }

// errEngineLeft is the cancel cause of an attempt whose engine left the
// ring before its answer began: a hung engine's calls go elsewhere as soon
// as a probe finds it out, not when their own timeout ends.
var errEngineLeft = errors.New("llmproxy: the engine left the ring (it failed its health probe) before it began to answer")

// untilEngineLeaves is ctx for an attempt on e, cancelled if e leaves the
// ring before the answer begins; stop ends the watch. Without an engine it
// is ctx itself.
func (x *exchange) untilEngineLeaves(ctx context.Context, e *engine) (context.Context, func()) {
	if e == nil {
		return ctx, func() {}
	}
	actx, cancel := context.WithCancelCause(ctx)
	stopWatch := context.AfterFunc(e.leaving(), func() { cancel(errEngineLeft) })
	x.answering = func() { stopWatch() }
	return actx, func() {
		stopWatch()
		x.answering = nil
		cancel(nil)
	}
}

// timeout bounds one attempt of the call.
func (x *exchange) timeout() time.Duration {
	if x.engines != nil && x.engines.cfg.Timeout > 0 {
		return x.engines.cfg.Timeout
	}
	return x.p.timeout
}
