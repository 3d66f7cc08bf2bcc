package rollout

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// Error categories (shared with the G2 wire).
const (
	categoryTimeout   = "timeout"
	categoryAgent     = "agent_error"
	categoryGrader    = "grader_error"
	categoryCancelled = "cancelled"
)

// sdkRequest converts the wire request to the SDK's view of it.
func sdkRequest(req *rolloutv1.InitRolloutRequest) *osmo.RolloutRequest {
	out := &osmo.RolloutRequest{
		RolloutID:        req.GetRolloutId(),
		ServerURL:        req.GetServerUrl(),
		Messages:         fromStructs(req.GetMessages()),
		CompletionParams: req.GetCompletionParams().AsMap(),
		ToolServerURL:    req.GetToolServerUrl(),
		MaxTurns:         osmo.DefaultMaxTurns,
		MaxTokensTotal:   osmo.DefaultMaxTokensTotal,
		Metadata:         map[string]any{},
		IdempotencyKey:   req.GetIdempotencyKey(),
	}
	if req.MaxTurns != nil {
		out.MaxTurns = int(req.GetMaxTurns())
	}
	if req.MaxTokensTotal != nil {
		out.MaxTokensTotal = int(req.GetMaxTokensTotal())
	}
	if req.Metadata != nil {
		out.Metadata = req.GetMetadata().AsMap()
	}
	return out
}

// initTools asks the agent loop for its tools, turning a panic into an error.
func (s *Service) initTools(rec *record) (resp *rolloutv1.InitRolloutResponse, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("get_tools panicked: %v", p)
		}
	}()
	tools, err := s.cfg.AgentLoop.GetTools(sdkRequest(rec.req))
	if err != nil {
		return nil, fmt.Errorf("get_tools failed: %w", err)
	}
	structs, err := toStructs(tools)
	if err != nil {
		return nil, fmt.Errorf("get_tools returned a tool that is not a JSON object: %w", err)
	}
	return &rolloutv1.InitRolloutResponse{RolloutId: rec.id, Tools: structs}, nil
}

// run takes a rollout from the queue to its one completion.
func (s *Service) run(rec *record) {
	log := s.log.With("rollout_id", rec.id, "sample_id", rec.sampleID)
	defer func() {
		if err := rec.log.close(); err != nil {
			log.Warn("event log", "error", err)
		}
	}()

	// Queue for a concurrency slot; shutdown cancels the wait.
	queued := time.Now()
	select {
	case s.sem <- struct{}{}:
		s.metrics.queued.Dec()
	case <-rec.runCtx.Done():
		s.metrics.queued.Dec()
		s.complete(rec, &outcome{status: osmo.StatusError, finish: "error", errMsg: "cancelled before the rollout started: " + cancelReason(rec.runCtx), category: categoryCancelled}, log)
		return
	}
	rec.rolloutSpan().AddEvent("started", trace.WithAttributes(osmoattr.QueueWait.Float64(ms(time.Since(queued)))))
	s.metrics.running.Inc()
	released := false
	release := func() {
		if !released {
			released = true
			s.metrics.running.Dec()
			<-s.sem
		}
	}
	defer release()

	rec.setState(rolloutv1.State_STATE_RUNNING)
	rec.log.write("start", nil)
	ctx, cancel := context.WithTimeout(rec.traced(rec.runCtx), s.cfg.RolloutTimeout)
	defer cancel()
	s.routes.Set(rec.id, llmproxy.Route{
		BaseURL:         strings.TrimRight(rec.req.GetServerUrl(), "/") + "/v1",
		APIKey:          rec.req.GetApiKey(),
		Model:           s.cfg.Model,
		InjectRolloutID: true,
		Context:         ctx,
	})
	req := sdkRequest(rec.req)
	tools := fromStructs(rec.initResp.GetTools())
	rt := &runtime{s: s, rec: rec, url: llmproxy.BaseURLFor(s.proxyURL, rec.id, rec.sampleID) + "/chat/completions"}
	agentCtx, agentSpan := s.startSpan(ctx, "invoke_agent "+s.cfg.AgentLoop.Name(), trace.SpanKindInternal,
		semconv.GenAIOperationNameInvokeAgent, semconv.GenAIAgentName(s.cfg.AgentLoop.Name()))
	res, runErr := s.runLoop(agentCtx, osmo.NewRolloutContext(req, tools, rt))
	s.routes.Delete(rec.id)
	// The slot is for running agents; grading and callbacks must not hold it.
	release()

	out := &outcome{}
	switch {
	case runErr != nil:
		out.status, out.finish, out.errMsg, out.category = osmo.StatusError, "error", runErr.Error(), categoryAgent
		switch {
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			out.category = categoryTimeout
			out.errMsg = fmt.Sprintf("rollout timed out after %s: %v", s.cfg.RolloutTimeout, runErr)
		case errors.Is(ctx.Err(), context.Canceled):
			out.category = categoryCancelled
			out.errMsg = "cancelled: " + cancelReason(rec.runCtx) + ": " + runErr.Error()
		}
	case res.Status == osmo.StatusError:
		out.status, out.finish, out.errMsg, out.category = osmo.StatusError, "error", res.ErrorMessage, categoryAgent
		if out.errMsg == "" {
			out.errMsg = "agent loop reported an error without a message"
		}
	default:
		out.status, out.finish, out.messages, out.reward, out.extra = osmo.StatusCompleted, res.FinishReason, res.FinalMessages, res.Reward, res.ExtraFields
	}
	if out.status == osmo.StatusError {
		fail(agentSpan, out.category, out.errMsg)
		log.WarnContext(agentCtx, "agent failed", "error", out.errMsg)
	}
	agentSpan.End()
	s.buildSample(rec, out)
	if out.status == osmo.StatusCompleted {
		s.grade(rec, out, log)
	}
	s.complete(rec, out, log)
}

// cancelReason says why a rollout's run context ended early.
func cancelReason(ctx context.Context) string {
	if errors.Is(context.Cause(ctx), errCancelled) {
		return "cancelled by request"
	}
	return "server shutting down"
}

// runLoop calls the agent loop, turning panics and nil results into errors.
func (s *Service) runLoop(ctx context.Context, rc *osmo.RolloutContext) (res *osmo.RolloutResult, err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.ErrorContext(ctx, "agent loop panicked", "rollout_id", rc.Request.RolloutID, "panic", p, "stack", string(debug.Stack()))
			res, err = nil, fmt.Errorf("agent loop panicked: %v", p)
		}
	}()
	res, err = s.cfg.AgentLoop.Run(ctx, rc)
	if err == nil && res == nil {
		err = errors.New("agent loop returned neither a result nor an error")
	}
	if err == nil && res.Status != osmo.StatusCompleted && res.Status != osmo.StatusError {
		err = fmt.Errorf("agent loop returned unknown status %q", res.Status)
	}
	return res, err
}

// outcome is what a rollout ends with, before it is delivered.
type outcome struct {
	status   string
	finish   string
	messages []osmo.Message
	reward   *float64
	extra    map[string]any
	errMsg   string
	category string
}

// label is the G1 ground truth: metadata.ground_truth as text.
func label(req *rolloutv1.InitRolloutRequest) *string {
	v, ok := req.GetMetadata().GetFields()["ground_truth"]
	if !ok {
		return nil
	}
	var text string
	switch k := v.GetKind().(type) {
	case *structpb.Value_NullValue:
		return nil
	case *structpb.Value_StringValue:
		text = k.StringValue
	default:
		text = osmo.SerializeToolResult(v.AsInterface())
	}
	return &text
}

// buildSample turns what the agent produced and the proxy recorded into the
// rollout's sample. The sample keeps its messages even when the rollout
// failed: nothing recorded is thrown away.
func (s *Service) buildSample(rec *record, out *outcome) {
	msgs, err := toStructs(out.messages)
	if err != nil {
		out.status, out.finish, out.category = osmo.StatusError, "error", categoryAgent
		out.errMsg = "final messages are not JSON objects: " + err.Error()
		msgs = nil
	}
	var extra *structpb.Struct
	if len(out.extra) > 0 {
		if e, err := structpb.NewStruct(jsonRoundTrip(out.extra)); err == nil {
			extra = e
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	calls := make([]*rolloutv1.LLMCall, 0, len(rec.calls))
	for _, c := range rec.calls {
		calls = append(calls, callProto(c))
	}
	rec.samples = []*rolloutv1.RolloutSample{{
		RolloutId:    rec.id,
		Id:           rec.sampleID,
		Messages:     msgs,
		Label:        rec.label,
		Metadata:     rec.metadata,
		Metrics:      rec.metricsLocked(time.Now()),
		ExtraFields:  extra,
		LlmCalls:     calls,
		AgentReward:  out.reward,
		FinishReason: out.finish,
		Workflow:     rec.workflow,
	}}
	rec.finish = out.finish
}

func jsonRoundTrip(m map[string]any) map[string]any {
	b, err := json.Marshal(m)
	if err != nil {
		return nil
	}
	var out map[string]any
	_ = json.Unmarshal(b, &out)
	return out
}

// grade sends the sample to the grader when there is one and the row has a
// ground truth; otherwise the agent's own reward (possibly none) stands.
func (s *Service) grade(rec *record, out *outcome, log *slog.Logger) {
	rec.mu.Lock()
	sample := rec.samples[0]
	rec.mu.Unlock()
	if s.cfg.Grader == nil || sample.Label == nil {
		return
	}
	rec.setState(rolloutv1.State_STATE_GRADING)
	// Grading survives shutdown's cancel: the sample is finished work.
	ctx, cancel := context.WithTimeout(rec.traced(rec.gradeCtx), s.cfg.GradeTimeout)
	defer cancel()
	// A client span: the grader service continues the trace from the
	// trace_context the grader client puts into the request.
	ctx, span := s.startSpan(ctx, "grade", trace.SpanKindClient, osmoattr.GraderName.String(s.cfg.GraderName))
	defer span.End()
	start := time.Now()
	resp, err := s.cfg.Grader.Grade(ctx, &graderv1.GradeRequest{
		RolloutId: rec.id,
		Samples:   []*rolloutv1.RolloutSample{sample},
		Label:     sample.Label,
		Metadata:  sample.Metadata,
		Grader:    s.cfg.GraderName,
	})
	if err == nil && resp.GetError() != "" {
		err = errors.New(resp.GetError())
	}
	var g *graderv1.SampleGrade
	if err == nil {
		for _, sg := range resp.GetGrades() {
			if sg.GetSampleId() == sample.GetId() {
				g = sg
			}
		}
		if g == nil {
			err = fmt.Errorf("grader answered without sample %q", sample.GetId())
		}
	}
	if err != nil {
		s.metrics.gradeDuration.WithLabelValues("error").Observe(time.Since(start).Seconds())
		out.status, out.category = osmo.StatusError, categoryGrader
		out.errMsg = "grading failed: " + err.Error()
		rec.log.write("grade_error", map[string]any{"error": err.Error()})
		fail(span, categoryGrader, err.Error())
		log.WarnContext(ctx, "grading failed", "error", err)
		return
	}
	rec.mu.Lock()
	rec.samples[0].Reward = g.Reward
	rec.samples[0].RemoveSample = g.GetRemoveSample()
	rec.mu.Unlock()
	out.reward = g.Reward
	s.metrics.gradeDuration.WithLabelValues("ok").Observe(time.Since(start).Seconds())
	rec.log.write("graded", map[string]any{"reward": g.Reward, "remove_sample": g.GetRemoveSample(), "cached": g.GetCached(), "grader": resp.GetGrader(), "duration_ms": ms(time.Since(start))})
	if span.IsRecording() {
		span.SetAttributes(osmoattr.GraderName.String(resp.GetGrader()), osmoattr.GradeCached.Bool(g.GetCached()), osmoattr.RemoveSample.Bool(g.GetRemoveSample()))
		if g.Reward != nil {
			span.SetAttributes(osmoattr.Reward.Float64(g.GetReward()))
		}
	}
	log.InfoContext(ctx, "graded", "reward", g.Reward, "grader", resp.GetGrader())
}

// complete records the outcome and posts the one G1 completion.
func (s *Service) complete(rec *record, out *outcome, log *slog.Logger) {
	end := time.Now()
	rec.mu.Lock()
	body := &completion{
		RolloutID:    rec.id,
		Status:       out.status,
		FinishReason: out.finish,
		ErrorMessage: out.errMsg,
		ExtraFields:  out.extra,
	}
	m := rec.metricsLocked(end)
	body.Metrics = &completionStats{
		TotalLatencyMS: m.TotalLatencyMs, LLMLatencyMS: m.LlmLatencyMs, ToolLatencyMS: m.ToolLatencyMs,
		NumLLMCalls: int(m.NumLlmCalls), NumToolCalls: int(m.NumToolCalls), PromptTokens: int(m.PromptTokens),
		ResponseTokens: int(m.ResponseTokens), MaxContextTokens: int(m.MaxContextTokens),
	}
	if out.status == osmo.StatusCompleted {
		body.FinalMessages = out.messages
		body.Reward = out.reward
	} else {
		// Osmosis sends an empty list with an ERROR, never null.
		body.FinalMessages = []map[string]any{}
		if out.category == categoryGrader {
			body.FinalMessages = out.messages
		}
	}
	if body.FinalMessages == nil {
		body.FinalMessages = []map[string]any{}
	}
	rec.reward = out.reward
	rec.errMsg, rec.errCategory = out.errMsg, out.category
	rec.mu.Unlock()

	url := strings.TrimRight(rec.req.GetServerUrl(), "/") + "/v1/rollout/completed"
	policy := callbackPolicy{
		Retries:   s.cfg.Client.CompleteRolloutRetries,
		BaseDelay: s.cfg.Client.RetryBaseDelay,
		MaxDelay:  s.cfg.Client.RetryMaxDelay,
		Timeout:   s.cfg.Client.Timeout,
	}
	// The completion is owed even when the rollout was cancelled.
	ctx := rec.traced(context.WithoutCancel(s.rolloutsCtx))
	cctx, span := s.startSpan(ctx, "deliver_completion", trace.SpanKindInternal,
		semconv.URLFull(url), osmoattr.RolloutStatus.String(out.status))
	attempts, err := postJSON(cctx, s.httpClient, url, rec.req.GetApiKey(), body, policy, log, s.metrics.callbacks)
	span.SetAttributes(osmoattr.Attempts.Int(attempts))
	fields := map[string]any{"status": out.status, "attempts": attempts}
	if err != nil {
		fields["error"] = err.Error()
		fail(span, "callback_failed", err.Error())
		log.ErrorContext(cctx, "completion callback failed", "error", err, "attempts", attempts)
	}
	span.End()
	rec.log.write("completion", fields)

	rec.mu.Lock()
	rec.finished = time.Now()
	switch {
	case out.status == osmo.StatusCompleted:
		rec.state = rolloutv1.State_STATE_SUCCEEDED
	case out.category == categoryCancelled:
		rec.state = rolloutv1.State_STATE_CANCELLED
	default:
		rec.state = rolloutv1.State_STATE_FAILED
	}
	if err != nil {
		rec.callbackErr = err.Error()
	}
	rec.mu.Unlock()
	s.completed.Add(1)
	s.metrics.finished.WithLabelValues(out.status, out.category).Inc()
	s.metrics.duration.WithLabelValues(out.status).Observe(time.Since(rec.created).Seconds())
	if out.reward != nil {
		s.metrics.rewards.Observe(*out.reward)
	}
	if err != nil {
		s.metrics.callbackFails.Inc()
	}
	s.store.finish(rec)
	log.InfoContext(ctx, "rollout finished", "status", out.status, "reward", out.reward, "callback_attempts", attempts)
	endRollout(rec.rolloutSpan(), out, body.Metrics)
}

// runtime is the osmo.Runtime of one rollout: Chat goes through the proxy
// bound to the rollout and its sample.
type runtime struct {
	s   *Service
	rec *record
	url string
}

func (rt *runtime) Chat(ctx context.Context, messages []osmo.Message, params map[string]any) (*osmo.ChatResult, error) {
	body := make(map[string]any, len(params)+2)
	for k, v := range params {
		body[k] = v
	}
	if _, ok := body["model"]; !ok {
		body["model"] = osmo.PlaceholderModel
	}
	body["messages"] = messages
	payload, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("chat: encode request: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, rt.url, bytes.NewReader(payload))
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := rt.s.llmClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("chat: read response: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("chat: LLM call failed: HTTP %d: %s", resp.StatusCode, errorText(data))
	}
	res, err := osmo.ParseChatCompletion(data)
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	return res, nil
}

// errorText extracts an OpenAI error message, else a snippet of the body.
func errorText(body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	body = bytes.TrimSpace(body)
	if len(body) > 200 {
		body = append(body[:200:200], "..."...)
	}
	return string(body)
}

func (rt *runtime) RecordToolCall(latency time.Duration) {
	rt.rec.addToolCall(latency)
	rt.rec.log.write("tool_call", map[string]any{"latency_ms": ms(latency)})
}

func (rt *runtime) LogEvent(name string, data map[string]any) { rt.rec.log.write(name, data) }

// recordCall attaches a proxied call to its rollout.
func (s *Service) recordCall(_ context.Context, c *llmproxy.Call) {
	rec := s.store.get(c.RolloutID)
	if rec == nil {
		return
	}
	rec.addCall(c)
	s.metrics.llmCall(c)
	ev := map[string]any{
		"sample_id": c.SampleID, "model": c.Model, "status_code": c.StatusCode, "latency_ms": ms(c.Latency),
		"prompt_tokens": c.Usage.PromptTokens, "completion_tokens": c.Usage.CompletionTokens,
		"finish_reason": c.FinishReason, "attempts": c.Attempts,
	}
	if c.Err != "" {
		ev["error"] = c.Err
	}
	rec.log.write("llm_call", ev)
}
