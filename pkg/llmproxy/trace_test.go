package llmproxy_test

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// tracedProxy is a proxy tracing into an in-memory exporter.
func tracedProxy(t *testing.T, cfg llmproxy.Config) (*harness, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	cfg.TracerProvider = tp
	return newProxy(t, cfg), exp
}

// clientTrace is the trace context of a caller's span.
func clientTrace(t *testing.T) (trace.SpanContext, map[string]string) {
	t.Helper()
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{0xa1, 0xb2, 1}, SpanID: trace.SpanID{0xc3, 2}, TraceFlags: trace.FlagsSampled, Remote: true,
	})
	carrier := propagation.MapCarrier{}
	telemetry.Propagator().Inject(trace.ContextWithSpanContext(context.Background(), sc), carrier)
	return sc, map[string]string{"Traceparent": carrier["traceparent"]}
}

func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// onlySpan returns the one span the proxy made.
func onlySpan(t *testing.T, exp *tracetest.InMemoryExporter) tracetest.SpanStub {
	t.Helper()
	spans := exp.GetSpans()
	if len(spans) != 1 {
		names := []string{}
		for _, s := range spans {
			names = append(names, s.Name)
		}
		t.Fatalf("the proxy made spans %v, want one", names)
	}
	return spans[0]
}

func TestChatSpanJSON(t *testing.T) {
	up := newUpstream(t, okJSON)
	h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1"})})
	parent, header := clientTrace(t)
	header[llmproxy.HeaderRolloutID], header[llmproxy.HeaderSampleID] = "r1", "s1"
	body := `{"model":"openai/osmosis-rollout","temperature":0.7,"top_p":0.9,"max_tokens":256,"seed":7,"messages":[{"role":"user","content":"What is 2+2?"}]}`
	resp, _ := post(t, h.url+"/v1/chat/completions", body, header)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	h.next(t)

	s := onlySpan(t, exp)
	if s.Name != "chat policy-v1" || s.SpanKind != trace.SpanKindClient {
		t.Errorf("span %q kind %v, want \"chat policy-v1\", client", s.Name, s.SpanKind)
	}
	if s.Parent.SpanID() != parent.SpanID() || s.SpanContext.TraceID() != parent.TraceID() {
		t.Errorf("span parent %v, want the client's span %v", s.Parent, parent)
	}
	got := attrs(s)
	for key, want := range map[attribute.Key]any{
		"gen_ai.operation.name":      "chat",
		"gen_ai.provider.name":       "openai",
		"gen_ai.request.model":       "policy-v1",
		"osmo.llm.requested_model":   "openai/osmosis-rollout",
		"gen_ai.request.temperature": 0.7,
		"gen_ai.request.top_p":       0.9,
		"gen_ai.request.max_tokens":  int64(256),
		"gen_ai.request.seed":        int64(7),
		"gen_ai.response.id":         "chatcmpl-1",
		"gen_ai.usage.input_tokens":  int64(10),
		"gen_ai.usage.output_tokens": int64(1),
		"osmo.rollout.id":            "r1",
		"osmo.sample.id":             "s1",
	} {
		if v, ok := got[key]; !ok || v.AsInterface() != want {
			t.Errorf("%s = %v, want %v", key, v.AsInterface(), want)
		}
	}
	if v := got["gen_ai.response.finish_reasons"].AsStringSlice(); len(v) != 1 || v[0] != "stop" {
		t.Errorf("finish reasons %v, want [stop]", v)
	}
	for _, key := range []attribute.Key{"gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.response.time_to_first_chunk", "error.type"} {
		if _, ok := got[key]; ok {
			t.Errorf("span has %s, want it absent", key)
		}
	}
	if s.Status.Code == codes.Error {
		t.Errorf("span status %v", s.Status)
	}

	// The policy sees the chat span as its caller.
	tp := up.only(t).header.Get("Traceparent")
	if want := "00-" + parent.TraceID().String() + "-" + s.SpanContext.SpanID().String() + "-01"; tp != want {
		t.Errorf("upstream traceparent %q, want %q", tp, want)
	}
}

func TestChatSpanStream(t *testing.T) {
	up := newUpstream(t, sseHandler("\n", toolStream...))
	h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	resp, _ := post(t, h.url+"/r/r1/s/s1/v1/chat/completions", streamBody, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	c := h.next(t)
	s := onlySpan(t, exp)
	got := attrs(s)
	if s.Name != "chat openai/osmosis-rollout" {
		t.Errorf("span name %q", s.Name)
	}
	ttft := got["gen_ai.response.time_to_first_chunk"].AsFloat64()
	if ttft <= 0 || ttft != c.TimeToFirstTokenMS/1000 {
		t.Errorf("time to first chunk %v s, want the recorded %v", ttft, c.TimeToFirstTokenMS)
	}
	if !got["gen_ai.request.stream"].AsBool() {
		t.Error("gen_ai.request.stream is not true")
	}
	if v := got["gen_ai.response.finish_reasons"].AsStringSlice(); len(v) != 1 || v[0] != "tool_calls" {
		t.Errorf("finish reasons %v, want [tool_calls]", v)
	}
	if got["gen_ai.usage.input_tokens"].AsInt64() != 3 || got["gen_ai.usage.output_tokens"].AsInt64() != 8 || got["gen_ai.usage.cache_read.input_tokens"].AsInt64() != 2 {
		t.Errorf("usage attributes %v", got)
	}
	if got["osmo.rollout.id"].AsString() != "r1" || got["osmo.sample.id"].AsString() != "s1" {
		t.Errorf("ids from the path missing: %v", got)
	}
	if s.Parent.IsValid() {
		t.Errorf("span has parent %v, want a root span (the client sent no trace)", s.Parent)
	}
}

func TestChatSpanRetriesAndErrors(t *testing.T) {
	t.Run("retried 503 then ok", func(t *testing.T) {
		var n atomic.Int32
		up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			if n.Add(1) == 1 {
				http.Error(w, "busy", http.StatusServiceUnavailable)
				return
			}
			okJSON(w, r)
		})
		h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), Retry: llmproxy.RetryPolicy{MaxRetries: 2}})
		post(t, h.url+"/v1/chat/completions", chatBody, ids)
		h.next(t)
		s := onlySpan(t, exp)
		if got := attrs(s)["osmo.attempts"].AsInt64(); got != 2 {
			t.Errorf("osmo.attempts = %d, want 2", got)
		}
		if len(s.Events) != 1 || s.Events[0].Name != "retry" {
			t.Fatalf("events %v, want one retry", s.Events)
		}
		ev := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Events[0].Attributes {
			ev[kv.Key] = kv.Value
		}
		if ev["osmo.attempt"].AsInt64() != 1 || ev["error.type"].AsString() != "503" || !strings.Contains(ev["exception.message"].AsString(), "busy") {
			t.Errorf("retry event %v", ev)
		}
		if s.Status.Code == codes.Error {
			t.Errorf("a call that succeeded in the end is marked failed: %v", s.Status)
		}
	})
	t.Run("4xx passed through", func(t *testing.T) {
		up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":{"message":"context too long"}}`, http.StatusBadRequest)
		})
		h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
		post(t, h.url+"/v1/chat/completions", chatBody, ids)
		h.next(t)
		s := onlySpan(t, exp)
		got := attrs(s)
		if s.Status.Code != codes.Error || got["error.type"].AsString() != "400" || got["http.response.status_code"].AsInt64() != 400 {
			t.Errorf("status %v, attributes %v; want an error of type 400", s.Status, got)
		}
		if got["server.address"].AsString() != "127.0.0.1" || got["server.port"].AsInt64() == 0 {
			t.Errorf("a failed call does not name the upstream: %v", got)
		}
	})
	t.Run("upstream down", func(t *testing.T) {
		h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: "http://127.0.0.1:1/v1"})})
		post(t, h.url+"/v1/chat/completions", chatBody, ids)
		h.next(t)
		s := onlySpan(t, exp)
		if s.Status.Code != codes.Error || attrs(s)["error.type"].AsString() != "transport" {
			t.Errorf("status %v, error.type %v; want transport", s.Status, attrs(s)["error.type"])
		}
	})
}

// TestRejectedRequestSpan: a request the proxy answers itself is an HTTP
// server span, not a chat span.
func TestRejectedRequestSpan(t *testing.T) {
	h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.NewRouteTable()})
	parent, header := clientTrace(t)
	header[llmproxy.HeaderRolloutID], header[llmproxy.HeaderSampleID] = "unknown", "s1"
	resp, _ := post(t, h.url+"/v1/chat/completions", chatBody, header)
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("status %d, want 404", resp.StatusCode)
	}
	h.next(t)
	s := onlySpan(t, exp)
	got := attrs(s)
	if s.Name != "POST /v1/chat/completions" || s.SpanKind != trace.SpanKindServer || s.Parent.SpanID() != parent.SpanID() {
		t.Errorf("span %q kind %v parent %v", s.Name, s.SpanKind, s.Parent.SpanID())
	}
	if got["http.response.status_code"].AsInt64() != 404 || got["error.type"].AsString() != "404" || got["osmo.rollout.id"].AsString() != "unknown" {
		t.Errorf("attributes %v", got)
	}
	if s.Status.Code == codes.Error {
		t.Errorf("a 4xx answer marks a server span failed: %v", s.Status)
	}

	exp.Reset()
	post(t, h.url+"/v2/nothing", chatBody, nil)
	if s := onlySpan(t, exp); s.Name != "POST" || attrs(s)["http.response.status_code"].AsInt64() != 404 {
		t.Errorf("unknown path: span %q %v", s.Name, attrs(s))
	}
}

func TestChatSpanContentOptIn(t *testing.T) {
	for _, capture := range []bool{false, true} {
		up := newUpstream(t, okJSON)
		h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), CaptureContent: capture})
		post(t, h.url+"/v1/chat/completions", chatBody, ids)
		h.next(t)
		got := attrs(onlySpan(t, exp))
		in, hasIn := got["gen_ai.input.messages"]
		out, hasOut := got["gen_ai.output.messages"]
		if hasIn != capture || hasOut != capture {
			t.Errorf("CaptureContent %v: input recorded %v, output recorded %v", capture, hasIn, hasOut)
		}
		if capture && (!strings.Contains(in.AsString(), "What is 2+2?") || !strings.HasPrefix(out.AsString(), `[{"role":"assistant"`)) {
			t.Errorf("content %q -> %q", in.AsString(), out.AsString())
		}
	}
}

// TestIDsFromBaggage: a client that sends the ids as baggage (the rollout
// service) gets them on the span through the baggage processor, once.
func TestIDsFromBaggage(t *testing.T) {
	up := newUpstream(t, okJSON)
	h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base})})
	carrier := propagation.MapCarrier{}
	telemetry.Propagator().Inject(osmoattr.ContextWithIDs(context.Background(), "r1", "s1"), carrier)
	post(t, h.url+"/v1/chat/completions", chatBody, map[string]string{
		llmproxy.HeaderRolloutID: "r1", llmproxy.HeaderSampleID: "s1", "Baggage": carrier["baggage"],
	})
	h.next(t)
	got := attrs(onlySpan(t, exp))
	if got["osmo.rollout.id"].AsString() != "r1" || got["osmo.sample.id"].AsString() != "s1" {
		t.Errorf("ids %v", got)
	}
	if b := up.only(t).header.Get("Baggage"); !strings.Contains(b, "osmo.rollout.id=r1") {
		t.Errorf("upstream baggage %q lacks the rollout id", b)
	}
}

func TestProxyMetrics(t *testing.T) {
	var n atomic.Int32
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		switch n.Add(1) {
		case 1:
			http.Error(w, "busy", http.StatusBadGateway)
		case 3:
			http.Error(w, "bad", http.StatusBadRequest)
		default:
			okJSON(w, r)
		}
	})
	reg := prometheus.NewRegistry()
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), Retry: llmproxy.RetryPolicy{MaxRetries: 1}, Metrics: reg})
	post(t, h.url+"/v1/chat/completions", chatBody, ids) // 502, then 200
	h.next(t)
	post(t, h.url+"/v1/chat/completions", chatBody, ids) // 400 passed through
	h.next(t)
	post(t, h.url+"/v1/chat/completions", `{"messages":[]}`, ids) // refused: 400 without upstream
	h.next(t)
	post(t, h.url+"/nothing", chatBody, nil) // 404

	want := `
# HELP osmo_llmproxy_requests_total Requests the LLM proxy answered, by HTTP status (499: the client went away first).
# TYPE osmo_llmproxy_requests_total counter
osmo_llmproxy_requests_total{code="200"} 1
osmo_llmproxy_requests_total{code="400"} 2
osmo_llmproxy_requests_total{code="404"} 1
# HELP osmo_llmproxy_upstream_attempts_total Upstream attempts by outcome: ok, rejected (4xx passed through), tokens_refused (a 400 or 422 to a call asking for token ids, asked again without them), http_5xx, timeout, transport, malformed, too_large, aborted, paused (cut by an abort pause, made again after the resume), invalid_route.
# TYPE osmo_llmproxy_upstream_attempts_total counter
osmo_llmproxy_upstream_attempts_total{outcome="http_5xx"} 1
osmo_llmproxy_upstream_attempts_total{outcome="ok"} 1
osmo_llmproxy_upstream_attempts_total{outcome="rejected"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "osmo_llmproxy_requests_total", "osmo_llmproxy_upstream_attempts_total"); err != nil {
		t.Error(err)
	}
	if got := testutil.CollectAndCount(reg, "osmo_llmproxy_added_latency_seconds"); got != 1 {
		t.Errorf("added latency histogram: %d series, want 1", got)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "osmo_llmproxy_added_latency_seconds" {
			if n := mf.GetMetric()[0].GetHistogram().GetSampleCount(); n != 3 {
				t.Errorf("added latency observed %d calls, want the 3 chat completions", n)
			}
		}
	}
}

// TestChatSpanParentedOnRouteWithoutClientTrace: a client that sends no
// trace context (an exec agent) still lands in the rollout's trace, through
// the span in the route's context.
func TestChatSpanParentedOnRouteWithoutClientTrace(t *testing.T) {
	up := newUpstream(t, okJSON)
	rollout := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{0x5e, 1}, SpanID: trace.SpanID{0x5f, 2}, TraceFlags: trace.FlagsSampled,
	})
	routeCtx := trace.ContextWithSpanContext(context.Background(), rollout)
	h, exp := tracedProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Context: routeCtx})})
	for _, tc := range []struct {
		name   string
		header map[string]string
		want   trace.SpanContext
	}{
		{"no client trace", map[string]string{}, rollout},
		{"client trace wins", nil, trace.SpanContext{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp.Reset()
			header, want := tc.header, tc.want
			if header == nil {
				want, header = clientTrace(t)
			}
			header[llmproxy.HeaderRolloutID], header[llmproxy.HeaderSampleID] = "r1", "s1"
			resp, _ := post(t, h.url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, header)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			h.next(t)
			s := onlySpan(t, exp)
			if s.Parent.TraceID() != want.TraceID() || s.Parent.SpanID() != want.SpanID() {
				t.Errorf("chat span parent %s/%s, want %s/%s", s.Parent.TraceID(), s.Parent.SpanID(), want.TraceID(), want.SpanID())
			}
		})
	}
}

// TestSampledOutCallPropagates: a call whose span is not sampled records
// nothing but still passes the trace (unsampled) and the baggage upstream,
// on every call of a rollout (the baggage propagator caches the header).
func TestSampledOutCallPropagates(t *testing.T) {
	up := newUpstream(t, okJSON)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()), sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newProxy(t, llmproxy.Config{Router: llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base}), TracerProvider: tp, Propagator: telemetry.Propagator()})
	parent, header := clientTrace(t)
	carrier := propagation.MapCarrier{}
	telemetry.Propagator().Inject(osmoattr.ContextWithIDs(context.Background(), "r1", "s1"), carrier)
	header["Baggage"] = carrier["baggage"] + ",user=alice%20b"
	header[llmproxy.HeaderRolloutID], header[llmproxy.HeaderSampleID] = "r1", "s1"
	for i := range 3 {
		post(t, h.url+"/v1/chat/completions", chatBody, header)
		h.next(t)
		got := up.requests()[i].header
		tp := got.Get("Traceparent")
		if !strings.HasPrefix(tp, "00-"+parent.TraceID().String()+"-") || !strings.HasSuffix(tp, "-00") || strings.Contains(tp, parent.SpanID().String()) {
			t.Errorf("call %d: upstream traceparent %q, want trace %s unsampled under a new span", i, tp, parent.TraceID())
		}
		bag, err := baggage.Parse(got.Get("Baggage"))
		if err != nil || bag.Len() != 3 || bag.Member("osmo.rollout.id").Value() != "r1" || bag.Member("osmo.sample.id").Value() != "s1" || bag.Member("user").Value() != "alice b" {
			t.Errorf("call %d: upstream baggage %q (%v)", i, got.Get("Baggage"), err)
		}
	}
	if spans := exp.GetSpans(); len(spans) != 0 {
		t.Errorf("%d spans recorded with sampling off", len(spans))
	}
}
