package llmproxy

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

const tracerName = "github.com/osmo-rl/osmo/pkg/llmproxy"

// tracing is the proxy's span machinery, set when Config.TracerProvider is.
type tracing struct {
	tracer   trace.Tracer
	prop     propagation.TextMapPropagator
	provider attribute.KeyValue
	content  bool
}

func newTracing(cfg Config) *tracing {
	t := &tracing{
		tracer:   cfg.TracerProvider.Tracer(tracerName),
		prop:     cfg.Propagator,
		provider: semconv.GenAIProviderNameKey.String(cfg.ProviderName),
		content:  cfg.CaptureContent,
	}
	if t.prop == nil {
		t.prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	if cfg.ProviderName == "" {
		t.provider = semconv.GenAIProviderNameKey.String(DefaultProviderName)
	}
	return t
}

// server is the server.address and server.port attributes of a route's
// base URL.
func server(baseURL string) []attribute.KeyValue {
	var attrs []attribute.KeyValue
	if u, err := url.Parse(baseURL); err == nil && u.Host != "" {
		host, port := u.Hostname(), u.Port()
		if port == "" {
			port = "80"
			if u.Scheme == "https" {
				port = "443"
			}
		}
		attrs = append(attrs, semconv.ServerAddress(host))
		if n, err := strconv.Atoi(port); err == nil {
			attrs = append(attrs, semconv.ServerPort(n))
		}
	} else if host, port, err := net.SplitHostPort(baseURL); err == nil {
		attrs = append(attrs, semconv.ServerAddress(host))
		if n, err := strconv.Atoi(port); err == nil {
			attrs = append(attrs, semconv.ServerPort(n))
		}
	}
	return attrs
}

// traceContext is the client's trace context (W3C trace context and
// baggage, by default) on top of r's context.
//
// A call that goes upstream is one span, the GenAI client span "chat
// {model}" (see startChat), child of the client's span. There is no HTTP
// server span beside it: measured with osmo bench, a second span per call
// cost the proxy about 6% of its throughput on top of the chat span's 8%,
// for no information the chat span lacks (otelhttp's handler cost more
// still). A call the proxy answers itself (a bad request, an unknown
// rollout, a 404) gets an HTTP server span instead (traceRejected).
//
// The handlers extract the context themselves, after the mux, and keep it
// beside the request rather than in a copy of it (r.WithContext): the copy
// was an allocation of 256 bytes per call for the garbage collector.
func (t *tracing) traceContext(r *http.Request) context.Context {
	return t.prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
}

// traceRejected records a request the proxy answered without calling
// upstream as an HTTP server span (OpenTelemetry HTTP semantic
// conventions) from start to now; ctx is the client's trace context.
func (p *Proxy) traceRejected(ctx context.Context, r *http.Request, start time.Time, status int, rolloutID, sampleID string) {
	t := p.tracing
	// The mux's pattern keeps the ids of path-bound calls out of the name.
	route := r.Pattern
	if i := strings.IndexByte(route, ' '); i >= 0 {
		route = route[i+1:]
	}
	name := r.Method
	if route != "" && route != "/" {
		name += " " + route
	}
	_, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(start))
	if !span.IsRecording() {
		span.End()
		return
	}
	attrs := []attribute.KeyValue{httpMethod(r.Method), semconv.URLPath(r.URL.Path), semconv.HTTPResponseStatusCode(status)}
	if route != "" && route != "/" {
		attrs = append(attrs, semconv.HTTPRoute(route))
	}
	if rolloutID != "" && !idsInBaggage(ctx, rolloutID, sampleID) {
		attrs = append(attrs, osmoattr.IDAttributes(rolloutID, sampleID)...)
	}
	if status >= 400 {
		attrs = append(attrs, semconv.ErrorTypeKey.String(strconv.Itoa(status)))
	}
	if status >= 500 {
		span.SetStatus(otelcodes.Error, "")
	}
	span.SetAttributes(attrs...)
	span.End()
}

func httpMethod(m string) attribute.KeyValue {
	switch m {
	case http.MethodPost:
		return semconv.HTTPRequestMethodPost
	case http.MethodGet, http.MethodPut, http.MethodDelete, http.MethodPatch, http.MethodHead, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return semconv.HTTPRequestMethodKey.String(m)
	}
	return semconv.HTTPRequestMethodOther
}

// startChat starts the GenAI client span of the upstream call ("chat
// {model}", OpenTelemetry GenAI semantic conventions) and returns its
// context. Its attributes are set by endChat, in one call.
//
// A client that sent no trace context (an exec agent in another language,
// say) still gets its call into the rollout's trace: the span is parented on
// the route's context when that carries a span.
func (x *exchange) startChat(ctx context.Context) context.Context {
	t := x.p.tracing
	if rc := x.route.Context; rc != nil && !trace.SpanContextFromContext(ctx).IsValid() {
		if sc := trace.SpanContextFromContext(rc); sc.IsValid() {
			ctx = trace.ContextWithSpanContext(ctx, sc)
			if baggage.FromContext(ctx).Len() == 0 {
				ctx = baggage.ContextWithBaggage(ctx, baggage.FromContext(rc))
			}
		}
	}
	ctx, x.span = t.tracer.Start(ctx, "chat "+x.call.Model, clientStart...)
	return ctx
}

// clientStart are the chat span's start options, made once: options are
// interface values, and a variadic argument list passed to an interface
// method is allocated per call.
var clientStart = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindClient)}

// appendParamAttrs adds the request's sampling parameters; values that are
// not numbers (null, say) are left out.
func (req *chatRequest) appendParamAttrs(attrs []attribute.KeyValue) []attribute.KeyValue {
	float := func(key string) (float64, bool) {
		var f float64
		err := json.Unmarshal(req.members[key], &f)
		return f, err == nil
	}
	integer := func(key string) (int, bool) {
		f, ok := float(key)
		return int(f), ok && f == float64(int(f))
	}
	if v, ok := float("temperature"); ok {
		attrs = append(attrs, semconv.GenAIRequestTemperature(v))
	}
	if v, ok := float("top_p"); ok {
		attrs = append(attrs, semconv.GenAIRequestTopP(v))
	}
	if v, ok := integer("max_tokens"); ok {
		attrs = append(attrs, semconv.GenAIRequestMaxTokens(v))
	} else if v, ok := integer("max_completion_tokens"); ok {
		attrs = append(attrs, semconv.GenAIRequestMaxTokens(v))
	}
	if v, ok := integer("seed"); ok {
		attrs = append(attrs, semconv.GenAIRequestSeed(v))
	}
	if v, ok := float("frequency_penalty"); ok {
		attrs = append(attrs, semconv.GenAIRequestFrequencyPenalty(v))
	}
	if v, ok := float("presence_penalty"); ok {
		attrs = append(attrs, semconv.GenAIRequestPresencePenalty(v))
	}
	if v, ok := integer("n"); ok && v != 1 {
		attrs = append(attrs, semconv.GenAIRequestChoiceCount(v))
	}
	return attrs
}

// retried records a failed attempt about to be retried on the chat span.
func (x *exchange) retried(attempt int, delay time.Duration, last *upstreamError) {
	if x.span == nil {
		return
	}
	attrs := []attribute.KeyValue{
		osmoattr.Attempt.Int(attempt),
		osmoattr.RetryDelay.Float64(float64(delay) / float64(time.Millisecond)),
		semconv.ErrorTypeKey.String(last.errType()),
		semconv.ExceptionMessage(last.Error()),
	}
	if n := len(x.tried); n > 0 {
		attrs = append(attrs, osmoattr.Engine.String(x.tried[n-1].url))
	}
	x.span.AddEvent("retry", trace.WithAttributes(attrs...))
}

// endChat records the call on the chat span and ends it.
func (x *exchange) endChat() {
	t, span, c := x.p.tracing, x.span, x.call
	if !span.IsRecording() {
		span.End()
		return
	}
	attrs := append(make([]attribute.KeyValue, 0, 24),
		semconv.GenAIOperationNameChat,
		t.provider,
		semconv.GenAIRequestModel(c.Model),
	)
	if c.RequestedModel != "" {
		attrs = append(attrs, osmoattr.RequestedModel.String(c.RequestedModel))
	}
	if !idsInBaggage(x.ctx, c.RolloutID, c.SampleID) {
		attrs = append(attrs, osmoattr.IDAttributes(c.RolloutID, c.SampleID)...)
	}
	attrs = x.req.appendParamAttrs(attrs)
	if c.Stream {
		attrs = append(attrs, semconv.GenAIRequestStream(true))
		if c.TimeToFirstTokenMS > 0 {
			attrs = append(attrs, semconv.GenAIResponseTimeToFirstChunk(c.TimeToFirstTokenMS/1000))
		}
	}
	if c.Attempts > 1 {
		attrs = append(attrs, osmoattr.Attempts.Int(c.Attempts))
	}
	if c.ID != "" {
		attrs = append(attrs, semconv.GenAIResponseID(c.ID))
	}
	if c.FinishReason != "" {
		attrs = append(attrs, semconv.GenAIResponseFinishReasons(c.FinishReason))
	}
	if u := c.Usage; u.PromptTokens > 0 || u.CompletionTokens > 0 {
		attrs = append(attrs, semconv.GenAIUsageInputTokens(u.PromptTokens), semconv.GenAIUsageOutputTokens(u.CompletionTokens))
		if u.CachedTokens > 0 {
			attrs = append(attrs, semconv.GenAIUsageCacheReadInputTokens(u.CachedTokens))
		}
	}
	if t.content {
		attrs = append(attrs, semconv.GenAIInputMessagesKey.String(string(x.req.messages)))
		if len(c.ResponseMessage) > 0 {
			attrs = append(attrs, semconv.GenAIOutputMessagesKey.String("["+string(c.ResponseMessage)+"]"))
		}
	}
	if c.Engine != "" {
		attrs = append(attrs, osmoattr.Engine.String(c.Engine))
	}
	if x.versioned {
		attrs = append(attrs, osmoattr.PolicyVersion.Int64(c.PolicyVersion))
	}
	if c.Error != "" {
		base := x.route.BaseURL
		if n := len(x.tried); n > 0 {
			base = x.tried[n-1].url
			if c.Engine == "" {
				attrs = append(attrs, osmoattr.Engine.String(base))
			}
		}
		attrs = append(attrs, server(base)...)
		if c.StatusCode != 0 {
			attrs = append(attrs, semconv.HTTPResponseStatusCode(c.StatusCode))
		}
		typ := x.errType
		if typ == "" {
			typ = semconv.ErrorTypeOther.Value.AsString()
		}
		attrs = append(attrs, semconv.ErrorTypeKey.String(typ))
		span.SetStatus(otelcodes.Error, c.Error)
	}
	span.SetAttributes(attrs...)
	span.End()
}

// idsInBaggage reports whether the client's baggage carries the call's ids
// (the rollout service's does), in which case every span started under it
// has them already (telemetry.BaggageAttributes).
func idsInBaggage(ctx context.Context, rolloutID, sampleID string) bool {
	bag := baggage.FromContext(ctx)
	return bag.Member(string(osmoattr.RolloutID)).Value() == rolloutID && bag.Member(string(osmoattr.SampleID)).Value() == sampleID
}
