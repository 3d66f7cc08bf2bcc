package rollout

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// workflowRuntime is the osmo.Runtime of one rollout: every sample's LLM
// calls go through the embedded proxy, bound to the rollout and the sample
// by the URL path, under the rollout's own token.
type workflowRuntime struct {
	s   *Service
	rec *record
	log *slog.Logger
}

func (rt *workflowRuntime) Endpoint(sampleID string) osmo.Endpoint {
	client := rt.s.llmClient
	if rt.s.tracer != nil {
		// Every call's spans carry osmo.sample.id, whatever context the
		// workflow calls with.
		c := *client
		c.Transport = sampleTransport{base: client.Transport, rolloutID: rt.rec.id, sampleID: sampleID}
		client = &c
	}
	return osmo.Endpoint{
		BaseURL: llmproxy.BaseURLFor(rt.s.proxyURL, rt.rec.id, sampleID),
		APIKey:  rt.rec.token,
		Headers: map[string]string{
			strings.ToLower(llmproxy.HeaderRolloutID): rt.rec.id,
			strings.ToLower(llmproxy.HeaderSampleID):  sampleID,
		},
		HTTPClient: client,
	}
}

// sampleTransport puts a rollout's and sample's ids into the baggage of
// each request before base (the traced transport) starts its span.
type sampleTransport struct {
	base                http.RoundTripper
	rolloutID, sampleID string
}

func (t sampleTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if ctx := osmoattr.ContextWithIDs(r.Context(), t.rolloutID, t.sampleID); ctx != r.Context() {
		r = r.WithContext(ctx)
	}
	return t.base.RoundTrip(r)
}

func (rt *workflowRuntime) Logger() *slog.Logger { return rt.log }

func (rt *workflowRuntime) LogEvent(name string, data map[string]any) { rt.rec.log.write(name, data) }

// RecordToolCall counts a tool call the sample's agent ran itself.
func (rt *workflowRuntime) RecordToolCall(sampleID string, latency time.Duration) {
	rt.rec.addToolCall(sampleID, latency)
	rt.rec.log.write("tool_call", map[string]any{"sample_id": sampleID, "latency_ms": ms(latency)})
}

// recordCall attaches a proxied call to its rollout.
func (s *Service) recordCall(_ context.Context, c *osmo.LLMCall) {
	rec := s.store.get(c.RolloutID)
	if rec == nil {
		return
	}
	rec.addCall(c)
	s.metrics.llmCall(c)
	ev := map[string]any{
		"sample_id": c.SampleID, "model": c.Model, "status_code": c.StatusCode, "latency_ms": c.LatencyMS,
		"prompt_tokens": c.Usage.PromptTokens, "completion_tokens": c.Usage.CompletionTokens,
		"finish_reason": c.FinishReason, "attempts": c.Attempts,
	}
	if c.Error != "" {
		ev["error"] = c.Error
	}
	rec.log.write("llm_call", ev)
}
