// Package llmproxy is an OpenAI-compatible chat-completions reverse proxy that
// sits between agents and the policy endpoint. It binds every call to a
// rollout and a sample, routes it, rewrites the placeholder model, retries
// the upstream like the Osmosis G1 client, streams SSE through untouched and
// records every call.
//
// A Proxy is an http.Handler; it serves
//
//	POST /v1/chat/completions                               (ids in X-Rollout-Id / X-Sample-Id)
//	POST /r/{rollout_id}/s/{sample_id}/v1/chat/completions  (ids in the path, see BaseURLFor)
//	POST /v1/responses, /r/{rollout_id}/s/{sample_id}/v1/responses
//
// Responses API calls are translated: the policy always receives a chat
// completion, and the client gets a Response object or Responses stream
// events back.
package llmproxy

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Defaults for the zero values of Config.
const (
	DefaultTimeout          = 300 * time.Second
	DefaultMaxBodyBytes     = 32 << 20
	DefaultMaxResponseBytes = 64 << 20
)

// Config configures a Proxy.
type Config struct {
	// Router finds the route of each call's rollout. Required.
	Router Router
	// Recorder receives every call, failed ones included. Nil records nothing.
	Recorder Recorder
	// Retry is the upstream retry rule (G1 semantics).
	Retry RetryPolicy
	// Timeout bounds one upstream attempt; 0 means DefaultTimeout. For a
	// stream it bounds the wait for each piece of the stream, so a long
	// generation that keeps producing is never cut.
	Timeout time.Duration
	// MaxBodyBytes is the largest request body accepted (413 above);
	// 0 means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxResponseBytes bounds what the proxy holds of an upstream answer:
	// a whole JSON body, or one SSE event (streams themselves are passed on
	// as they come and may be longer); 0 means DefaultMaxResponseBytes.
	MaxResponseBytes int64
	// Transport carries upstream calls. Nil means DefaultTransport(), a
	// transport tuned for many concurrent calls to one policy endpoint.
	// A transport error that wraps one with a Permanent() bool method
	// answering true (a connection an outbound address policy refused, say)
	// fails the call at once: retrying would be refused again.
	Transport http.RoundTripper
	// Logger receives call logs; nil discards them.
	Logger *slog.Logger
	// RequireSampleID rejects calls without a sample id (400), as the
	// reference controller did.
	RequireSampleID bool
	// AskTokens asks the policy for what training rows need, whatever the
	// client asked: return_token_ids and logprobs (vLLM), and
	// return_prompt_token_ids (SGLang) but on a stream, each unless the
	// body sets it. The client gets the answer as the policy sent it,
	// token members included. An upstream that answers 400 or 422 is
	// asked again at once without them; if it then answers, later calls of
	// its kind (stream or not) do not ask it (see MaxRefusingUpstreams).
	// Every call without token ids records why (NoTokensReason).
	AskTokens bool

	// Metrics, when set, receives the proxy's Prometheus collectors
	// (osmo_llmproxy_*).
	Metrics prometheus.Registerer
	// TracerProvider, when set, traces every request under the client's
	// trace context: a call that goes upstream is an OpenTelemetry GenAI
	// client span "chat {model}", whose trace context is sent upstream; a
	// request the proxy answers itself is an HTTP server span.
	TracerProvider trace.TracerProvider
	// Propagator reads the client's and writes the upstream's trace context
	// (W3C trace context and baggage when nil).
	Propagator propagation.TextMapPropagator
	// CaptureContent records the request messages and the response message
	// on chat spans (gen_ai.input.messages, gen_ai.output.messages). Off by
	// default: prompts may be sensitive, and they are large.
	CaptureContent bool
	// ProviderName is the gen_ai.provider.name of chat spans; empty means
	// DefaultProviderName, the API family every policy server osmo talks
	// to speaks.
	ProviderName string

	// Engines, when set, carries the calls of routes without a BaseURL
	// over a set of policy engines (consistent hashing of the rollout and
	// sample ids with bounded loads, health, failover to another engine),
	// and every call when EnginesOwnRouting is set. The caller runs
	// Engines.Run.
	Engines *Engines
	// EnginesOwnRouting sends every call to Engines, even when the route
	// names its own BaseURL (the trainer's per-rollout URL).
	EnginesOwnRouting bool
	// Gate, when set, holds calls while the policy is paused for a weight
	// update and stamps every call with the policy version (gate.go).
	Gate *Gate
}

// DefaultProviderName is the gen_ai.provider.name of chat spans when
// Config.ProviderName is empty.
const DefaultProviderName = "openai"

// Proxy is the chat-completions proxy. It is safe for concurrent use.
type Proxy struct {
	router          Router
	recorder        Recorder
	retry           RetryPolicy
	timeout         time.Duration
	maxBody         int64
	maxResp         int64
	transport       http.RoundTripper
	log             *slog.Logger
	requireSampleID bool
	askTokens       bool
	refusals        *refusals
	mux             *http.ServeMux
	metrics         *metrics
	tracing         *tracing // nil when not traced

	engines           *Engines
	enginesOwnRouting bool
	gate              *Gate // nil when calls are never paused
}

// New validates cfg and returns a Proxy.
func New(cfg Config) (*Proxy, error) {
	switch {
	case cfg.Router == nil:
		return nil, errors.New("llmproxy.New: Config.Router is required")
	case cfg.Timeout < 0:
		return nil, fmt.Errorf("llmproxy.New: Config.Timeout must not be negative, got %s", cfg.Timeout)
	case cfg.MaxBodyBytes < 0:
		return nil, fmt.Errorf("llmproxy.New: Config.MaxBodyBytes must not be negative, got %d", cfg.MaxBodyBytes)
	case cfg.MaxResponseBytes < 0:
		return nil, fmt.Errorf("llmproxy.New: Config.MaxResponseBytes must not be negative, got %d", cfg.MaxResponseBytes)
	case cfg.Retry.MaxRetries < 0:
		return nil, fmt.Errorf("llmproxy.New: Config.Retry.MaxRetries must not be negative, got %d", cfg.Retry.MaxRetries)
	case cfg.Retry.BaseDelay < 0 || cfg.Retry.MaxDelay < 0:
		return nil, errors.New("llmproxy.New: Config.Retry delays must not be negative")
	}
	p := &Proxy{
		router:          cfg.Router,
		recorder:        cfg.Recorder,
		retry:           cfg.Retry,
		timeout:         cfg.Timeout,
		maxBody:         cfg.MaxBodyBytes,
		maxResp:         cfg.MaxResponseBytes,
		transport:       cfg.Transport,
		log:             cfg.Logger,
		requireSampleID: cfg.RequireSampleID,
		askTokens:       cfg.AskTokens,
		metrics:         newMetrics(cfg.Metrics),

		engines:           cfg.Engines,
		enginesOwnRouting: cfg.EnginesOwnRouting,
		gate:              cfg.Gate,
	}
	if p.timeout == 0 {
		p.timeout = DefaultTimeout
	}
	if p.maxBody == 0 {
		p.maxBody = DefaultMaxBodyBytes
	}
	if p.maxResp == 0 {
		p.maxResp = DefaultMaxResponseBytes
	}
	if p.transport == nil {
		p.transport = DefaultTransport()
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	p.refusals = newRefusals(p.log)

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		p.serve(w, r, APIChatCompletions, r.Header.Get(HeaderRolloutID), r.Header.Get(HeaderSampleID), "header "+HeaderRolloutID)
	})
	mux.HandleFunc("POST /r/{rollout_id}/s/{sample_id}/v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		p.serve(w, r, APIChatCompletions, r.PathValue("rollout_id"), r.PathValue("sample_id"), "path segment rollout_id")
	})
	// The Responses API, translated to chat completions (responses.go).
	mux.HandleFunc("POST /v1/responses", func(w http.ResponseWriter, r *http.Request) {
		p.serve(w, r, APIResponses, r.Header.Get(HeaderRolloutID), r.Header.Get(HeaderSampleID), "header "+HeaderRolloutID)
	})
	mux.HandleFunc("POST /r/{rollout_id}/s/{sample_id}/v1/responses", func(w http.ResponseWriter, r *http.Request) {
		p.serve(w, r, APIResponses, r.PathValue("rollout_id"), r.PathValue("sample_id"), "path segment rollout_id")
	})
	// Known paths with another method get a 405 in the OpenAI error shape
	// rather than the mux's plain-text one.
	notAllowed := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", http.MethodPost)
		p.metrics.request(http.StatusMethodNotAllowed)
		if p.tracing != nil {
			p.traceRejected(p.tracing.traceContext(r), r, time.Now(), http.StatusMethodNotAllowed, "", "")
		}
		p.writeError(w, serverTiming(0, 0, 0), http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "",
			fmt.Sprintf("llmproxy: method %s not allowed on %s; use POST", r.Method, r.URL.Path))
	}
	for _, api := range [...]string{"chat/completions", "responses"} {
		mux.HandleFunc("/v1/"+api, notAllowed)
		mux.HandleFunc("/r/{rollout_id}/s/{sample_id}/v1/"+api, notAllowed)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		p.metrics.request(http.StatusNotFound)
		if p.tracing != nil {
			p.traceRejected(p.tracing.traceContext(r), r, time.Now(), http.StatusNotFound, "", "")
		}
		p.writeError(w, serverTiming(0, 0, 0), http.StatusNotFound, "invalid_request_error", "not_found", "",
			fmt.Sprintf("llmproxy: no route for %s %s; the proxy serves POST /v1/chat/completions and /v1/responses, also under /r/{rollout_id}/s/{sample_id}", r.Method, r.URL.Path))
	})
	p.mux = mux
	if cfg.TracerProvider != nil {
		p.tracing = newTracing(cfg)
	}
	return p, nil
}

// ServeHTTP implements http.Handler.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mux.ServeHTTP(w, r)
}

// DefaultTransport returns a new upstream transport set up as the one New
// uses when Config.Transport is nil, for callers that wrap it (to add
// instrumentation or TLS settings, say) or measure against it. Each call
// returns a transport with a connection pool of its own.
//
// Its keep-alive connections are sized for the G1 client's concurrency
// (100 calls in flight), so calls do not pay for new connections under
// load. Connections are not capped: queueing calls in the proxy would only
// hide load from the policy server, which batches better the more it sees.
// Compression is off: responses are small or streamed, and gzip would cost
// CPU on both ends and can hold SSE events back in the compressor.
func DefaultTransport() *http.Transport {
	return &http.Transport{
		Proxy: http.ProxyFromEnvironment,
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          200,
		MaxIdleConnsPerHost:   100,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
	}
}

// errAttemptTimeout is the cancel cause of an attempt that ran out of time.
var errAttemptTimeout = errors.New("upstream attempt timed out")

// errRolloutEnded is the cancel cause when the route's context ends.
var errRolloutEnded = errors.New("rollout ended")
