package cli

import (
	"flag"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// policyFlags configure the policy engines behind the LLM proxy (serve,
// rollout, llmproxy).
type policyFlags struct {
	urls                                urlList
	ownsRouting                         bool
	loadFactor                          float64
	probeInterval, probeTimeout, linger time.Duration
	probeMaxInterval, resolveInterval   time.Duration
	failThreshold, minRetries           int
	timeout                             time.Duration
	retryBudget                         float64
	// fromEnv are the engines OSMO_POLICY names, used when no --policy is
	// given (a compose file or a manifest sets them in one variable).
	fromEnv []string
}

// urlList is a repeated flag.
type urlList []string

func (l *urlList) String() string { return strings.Join(*l, ",") }

func (l *urlList) Set(v string) error {
	*l = append(*l, v)
	return nil
}

func (f *policyFlags) register(fs *flag.FlagSet, e *env) {
	f.fromEnv = strings.FieldsFunc(e.getenv("OSMO_POLICY"), func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\t' })
	fs.Var(&f.urls, "policy", "a policy engine: its OpenAI base `URL` (http://vllm-0:8000/v1), or dns://NAME:PORT/v1 for every address of a DNS name (a headless Service), looked up again as pods come and go; "+
		"repeat for more engines (env OSMO_POLICY: engines separated by commas or spaces, when no --policy is given). Calls of one sample go to one engine (consistent hashing with bounded loads, header X-Session-ID); "+
		"a rollout whose trainer names its own policy URL still goes there unless --policy-owns-routing")
	fs.BoolVar(&f.ownsRouting, "policy-owns-routing", false, "with --policy: route every LLM call over the engines, even when the trainer names a policy URL (chat_completions_url, server_url)")
	fs.Float64Var(&f.loadFactor, "policy-load-factor", llmproxy.DefaultLoadFactor, "with --policy: no engine takes a call while it holds this many times the mean of calls in flight (at least 1); the call goes to the next engine on the ring")
	fs.DurationVar(&f.probeInterval, "policy-probe-interval", llmproxy.DefaultProbeInterval, "with --policy: time between health probes of an engine (GET /health, else /v1/models); a failed probe takes it out of the ring")
	fs.DurationVar(&f.probeTimeout, "policy-probe-timeout", llmproxy.DefaultProbeTimeout, "with --policy: bound of one health probe")
	fs.DurationVar(&f.probeMaxInterval, "policy-probe-max-interval", llmproxy.DefaultProbeMaxInterval, "with --policy: an engine out of the ring is probed back with backoff up to this interval")
	fs.IntVar(&f.failThreshold, "policy-fail-threshold", llmproxy.DefaultFailThreshold, "with --policy: calls failing in a row (5xx, timeout, broken connection) that take an engine out of the ring; a refused connection takes it out at once")
	fs.DurationVar(&f.resolveInterval, "policy-resolve-interval", llmproxy.DefaultResolveInterval, "with --policy dns://...: time between lookups of the name")
	fs.DurationVar(&f.timeout, "policy-timeout", 0, "with --policy: bound of one attempt on an engine (the wait for its answer, or for each piece of a stream); 0: the per-attempt timeout of LLM calls")
	fs.Float64Var(&f.retryBudget, "policy-retry-budget", llmproxy.DefaultRetryBudget, "with --policy: retries after a 5xx or a timeout in flight over the engines at most this fraction of the calls in flight (at least --policy-min-retries); past it a failed call is not retried (a retry after a broken connection is not counted)")
	fs.IntVar(&f.minRetries, "policy-min-retries", llmproxy.DefaultMinRetries, "with --policy: retries that may be in flight whatever --policy-retry-budget")
	fs.DurationVar(&f.linger, "policy-linger", llmproxy.DefaultLinger, "with --policy: a sample's slot stays counted in its engine's load this long after a call answered, so its next call keeps the engine (negative: count calls in flight only)")
}

// engines builds the engine set, with extra URLs before the --policy ones;
// nil when there are none.
func (f *policyFlags) engines(log *slog.Logger, reg prometheus.Registerer, extra ...string) (*llmproxy.Engines, error) {
	own := f.urls
	if len(own) == 0 {
		own = f.fromEnv
	}
	urls := append(append([]string(nil), extra...), own...)
	if len(urls) == 0 {
		if f.ownsRouting {
			return nil, usagef("--policy-owns-routing: needs at least one --policy engine")
		}
		return nil, nil
	}
	switch {
	case f.loadFactor < 1:
		return nil, usagef("--policy-load-factor: must be at least 1, got %v", f.loadFactor)
	case f.probeInterval <= 0:
		return nil, usagef("--policy-probe-interval: must be positive, got %s", f.probeInterval)
	case f.probeTimeout <= 0:
		return nil, usagef("--policy-probe-timeout: must be positive, got %s", f.probeTimeout)
	case f.probeMaxInterval <= 0:
		return nil, usagef("--policy-probe-max-interval: must be positive, got %s", f.probeMaxInterval)
	case f.resolveInterval <= 0:
		return nil, usagef("--policy-resolve-interval: must be positive, got %s", f.resolveInterval)
	case f.timeout < 0:
		return nil, usagef("--policy-timeout: must not be negative, got %s", f.timeout)
	case f.retryBudget <= 0:
		return nil, usagef("--policy-retry-budget: must be above 0, got %v", f.retryBudget)
	case f.minRetries < 1:
		return nil, usagef("--policy-min-retries: must be at least 1, got %d", f.minRetries)
	case f.failThreshold < 1:
		return nil, usagef("--policy-fail-threshold: must be at least 1, got %d", f.failThreshold)
	}
	linger := f.linger
	if linger == 0 {
		linger = -1 // 0 on the command line means none, not the default
	}
	e, err := llmproxy.NewEngines(llmproxy.EnginesConfig{
		URLs:             urls,
		LoadFactor:       f.loadFactor,
		ProbeInterval:    f.probeInterval,
		ProbeTimeout:     f.probeTimeout,
		ProbeMaxInterval: f.probeMaxInterval,
		FailThreshold:    f.failThreshold,
		ResolveInterval:  f.resolveInterval,
		Linger:           linger,
		Timeout:          f.timeout,
		RetryBudget:      f.retryBudget,
		MinRetries:       f.minRetries,
		Metrics:          reg,
		Logger:           log,
	})
	if err != nil {
		return nil, usagef("--policy: %v", err)
	}
	return e, nil
}
