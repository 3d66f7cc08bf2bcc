package llmproxy_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// TestSpanPipelinesAgree runs the same calls through the proxy traced as
// in production, once with each span pipeline (OSMO_TRACE_PIPELINE), and
// checks that the collector receives the same spans from both: names,
// kinds, parents, attributes, events, statuses, resource and scope; ids
// and times aside.
func TestSpanPipelinesAgree(t *testing.T) {
	var n atomic.Int32
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		switch n.Add(1) {
		case 1: // the first call's first try
			http.Error(w, "busy", http.StatusServiceUnavailable)
		case 3: // the second call
			http.Error(w, `{"error":{"message":"context too long"}}`, http.StatusBadRequest)
		default:
			okJSON(w, r)
		}
	})
	parent, header := clientTrace(t)
	header[llmproxy.HeaderRolloutID], header[llmproxy.HeaderSampleID] = "r1", "s1"

	received := map[string]*coltracepb.ExportTraceServiceRequest{}
	for _, pipeline := range []string{telemetry.PipelineSDK, telemetry.PipelineDirect} {
		n.Store(0)
		sink := &otlpSink{}
		srv := httptest.NewServer(sink)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		tel, err := telemetry.Setup(ctx, "osmo-llmproxy", func(k string) string {
			return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL, "OSMO_TRACE_PIPELINE": pipeline}[k]
		})
		if err != nil {
			t.Fatal(err)
		}
		h := newProxy(t, llmproxy.Config{
			Router:         llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1"}),
			Retry:          llmproxy.RetryPolicy{MaxRetries: 2, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond},
			TracerProvider: tel.DirectTracerProvider("osmo-llmproxy"),
			Propagator:     tel.Propagator(),
		})
		for _, body := range []string{
			`{"model":"openai/osmosis-rollout","temperature":0.7,"max_tokens":64,"messages":[{"role":"user","content":"What is 2+2?"}]}`,
			chatBody,
		} {
			post(t, h.url+"/v1/chat/completions", body, header)
			h.next(t)
		}
		post(t, h.url+"/v1/chat/completions", `{"messages":`, header) // answered by the proxy itself
		if err := tel.Shutdown(ctx); err != nil {
			t.Fatalf("%s: Shutdown: %v", pipeline, err)
		}
		cancel()
		srv.Close()
		received[pipeline] = sink.merged(t)
	}

	sdk, direct := received[telemetry.PipelineSDK], received[telemetry.PipelineDirect]
	for _, req := range []*coltracepb.ExportTraceServiceRequest{sdk, direct} {
		normalize(req, parent.SpanID())
	}
	if n := len(direct.GetResourceSpans()[0].GetScopeSpans()[0].GetSpans()); n != 3 {
		t.Fatalf("the direct pipeline exported %d spans, want 3 (two chat calls, one rejected request)", n)
	}
	if !proto.Equal(sdk, direct) {
		t.Errorf("the pipelines exported different spans\nsdk:\n%s\ndirect:\n%s", prototext.Format(sdk), prototext.Format(direct))
	}
}

// otlpSink is an OTLP/HTTP receiver keeping every request.
type otlpSink struct {
	mu   sync.Mutex
	reqs []*coltracepb.ExportTraceServiceRequest
}

func (s *otlpSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	req := &coltracepb.ExportTraceServiceRequest{}
	if err == nil {
		err = proto.Unmarshal(b, req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	s.reqs = append(s.reqs, req)
	s.mu.Unlock()
}

// merged is every span received, under the first request's resource and
// scope (the proxy has one of each).
func (s *otlpSink) merged(t *testing.T) *coltracepb.ExportTraceServiceRequest {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.reqs) == 0 {
		t.Fatal("nothing was exported")
	}
	out := proto.Clone(s.reqs[0]).(*coltracepb.ExportTraceServiceRequest)
	ss := out.GetResourceSpans()[0].GetScopeSpans()[0]
	for _, req := range s.reqs[1:] {
		for _, rs := range req.GetResourceSpans() {
			for _, sc := range rs.GetScopeSpans() {
				ss.Spans = append(ss.Spans, sc.GetSpans()...)
			}
		}
	}
	return out
}

// normalize clears what differs between two runs: ids (but for the
// client's span as a parent), times and the retry delay.
func normalize(req *coltracepb.ExportTraceServiceRequest, client [8]byte) {
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				sp.TraceId, sp.SpanId = nil, nil
				if string(sp.ParentSpanId) != string(client[:]) {
					sp.ParentSpanId = nil
				}
				sp.StartTimeUnixNano, sp.EndTimeUnixNano = 0, 0
				for _, ev := range sp.GetEvents() {
					ev.TimeUnixNano = 0
					zeroAttr(ev.GetAttributes(), "osmo.retry.delay_ms")
				}
			}
		}
	}
}

func zeroAttr(kvs []*commonpb.KeyValue, key string) {
	for _, kv := range kvs {
		if kv.GetKey() == key {
			kv.Value = &commonpb.AnyValue{}
		}
	}
}
