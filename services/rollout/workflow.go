package rollout

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strings"
	"time"

	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// G2 error categories (PROTOCOL.md); categoryTimeout and categoryAgent are
// shared with G1.
const (
	categoryValidation = "validation_error"
	categoryHTTP       = "http_error"
)

// workflowGrace is how long a workflow may take to return once its
// context ended before the rollout is reported without it.
const workflowGrace = time.Second

// retryAfter is what a G2 trainer is told to wait when the server is full.
const retryAfter = 5 * time.Second

// StartRollout implements the G2 POST /rollout.
func (s *Service) StartRollout(ctx context.Context, req *rolloutv1.StartRolloutRequest) (*rolloutv1.StartRolloutResponse, error) {
	if s.cfg.Workflow == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "this server runs the agent loop %q: start rollouts with POST /v1/rollout/init (G1), not /rollout", s.cfg.AgentLoop.Name())
	}
	if err := validateStart(req, s.cfg.MaxMetadataBytes); err != nil {
		s.metrics.rejected.WithLabelValues(rejectInvalid).Inc()
		s.reportRejected(ctx, req, err)
		return nil, err
	}
	rec := &record{
		id:       req.GetRolloutId(),
		key:      req.GetRolloutId(),
		workflow: s.cfg.Workflow.Name(),
		g2:       req,
		metadata: req.GetMetadata(),
		label:    labelText(req.GetLabel()),
		token:    newToken(),
		state:    rolloutv1.State_STATE_QUEUED,
		created:  time.Now(),
		ready:    make(chan struct{}),
	}
	// Admission and the capacity check happen under one lock so a burst
	// cannot overshoot MaxQueued.
	s.admitMu.Lock()
	if s.queuedG2.Load() >= int64(s.cfg.MaxQueued) && s.store.get(rec.id) == nil {
		s.admitMu.Unlock()
		s.metrics.rejected.WithLabelValues(rejectCapacity).Inc()
		st, _ := status.New(codes.ResourceExhausted, fmt.Sprintf("at capacity: %d rollouts running and %d queued; retry later", s.runningG2.Load(), s.queuedG2.Load())).
			WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
		return nil, st.Err()
	}
	_, dup, ok := s.store.admit(rec)
	if !ok || dup {
		s.admitMu.Unlock()
		// The same rollout id again (a trainer retrying a POST whose answer
		// it lost): accepted once, run once.
		s.log.InfoContext(ctx, "duplicate start ignored", "rollout_id", rec.id)
		return &rolloutv1.StartRolloutResponse{}, nil
	}
	s.queuedG2.Add(1)
	s.admitMu.Unlock()

	rec.log = s.logs.open(rec.id)
	rec.initContexts(s.rolloutsCtx)
	s.startRollout(ctx, rec)
	close(rec.ready)
	rec.log.write("start_request", map[string]any{
		"num_messages": len(req.GetInitialMessages()), "has_label": rec.label != nil,
		"has_metadata": req.Metadata != nil, "grader_callback": req.GraderCallbackUrl != nil,
	})
	s.log.InfoContext(ctx, "rollout accepted", "rollout_id", rec.id, "workflow", rec.workflow)
	s.metrics.started.Inc()
	s.metrics.queued.Inc()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.runWorkflow(rec)
	}()
	return &rolloutv1.StartRolloutResponse{}, nil
}

// GetRolloutStatus implements GET /rollout/{id}/status.
func (s *Service) GetRolloutStatus(_ context.Context, req *rolloutv1.GetRolloutStatusRequest) (*rolloutv1.RolloutStatus, error) {
	if req.GetRolloutId() == "" {
		return nil, badField("rollout_id", "required")
	}
	rec := s.store.get(req.GetRolloutId())
	if rec == nil {
		return &rolloutv1.RolloutStatus{RolloutId: req.GetRolloutId(), Status: "unknown"}, nil
	}
	return rec.status(), nil
}

// CancelRollouts implements POST /rollout/cancel.
func (s *Service) CancelRollouts(ctx context.Context, req *rolloutv1.CancelRolloutsRequest) (*rolloutv1.CancelRolloutsResponse, error) {
	if err := validateCancel(req); err != nil {
		return nil, err
	}
	out := &rolloutv1.CancelRolloutsResponse{Dispositions: map[string]string{}}
	var recs []*record
	switch {
	case len(req.GetIds()) > 0:
		for _, id := range req.GetIds() {
			if rec := s.store.get(id); rec != nil {
				recs = append(recs, rec)
			} else {
				out.Dispositions[id] = dispositionNotFound
			}
		}
	default:
		prefix := req.GetPrefix() // "" with all
		recs = s.store.unfinished(func(id string) bool { return strings.HasPrefix(id, prefix) })
	}
	// Queued rollouts go first: cancelling a running one frees a slot that
	// a queued one about to be cancelled would otherwise take.
	queued := make([]*record, 0, len(recs))
	var others []*record
	for _, rec := range recs {
		if rec.isQueued() {
			queued = append(queued, rec)
		} else {
			others = append(others, rec)
		}
	}
	recs = append(queued, others...)
	for _, rec := range recs {
		d := rec.cancel()
		if d == dispositionNotFound && len(req.GetIds()) == 0 {
			// By prefix or all, only what this call stopped is listed: a
			// rollout already over (still delivering its callbacks) is not.
			continue
		}
		out.Dispositions[rec.id] = d
		if d != dispositionNotFound {
			rec.log.write("cancel", map[string]any{"disposition": d})
			s.log.InfoContext(ctx, "rollout cancelled", "rollout_id", rec.id, "disposition", d)
		}
	}
	return out, nil
}

// labelText is the G2 label as text: strings as they are, numbers and
// booleans as JSON; null or unset is no label.
func labelText(v *structpb.Value) *string {
	switch k := v.GetKind().(type) {
	case nil, *structpb.Value_NullValue:
		return nil
	case *structpb.Value_StringValue:
		return &k.StringValue
	default:
		text := osmo.SerializeToolResult(v.AsInterface())
		return &text
	}
}

func newToken() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return "osmo-rt-" + hex.EncodeToString(b[:])
}

// status renders the G3 status body.
func (r *record) status() *rolloutv1.RolloutStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := &rolloutv1.RolloutStatus{RolloutId: r.id, Reward: r.reward}
	if msg := r.errMsg; msg != "" {
		out.ErrMessage = &msg
	}
	if cat := r.errCategory; cat != "" {
		out.ErrCategory = &cat
	}
	switch r.state {
	case rolloutv1.State_STATE_QUEUED:
		out.Status = "queued"
	case rolloutv1.State_STATE_RUNNING:
		out.Status = "running"
	case rolloutv1.State_STATE_GRADING:
		out.Status = "grading"
	case rolloutv1.State_STATE_SUCCEEDED:
		out.Status = "success"
	case rolloutv1.State_STATE_CANCELLED:
		out.Status = "cancelled"
	case rolloutv1.State_STATE_FAILED:
		out.Status = "failure"
	default:
		out.Status = "unknown"
	}
	return out
}

// wfOutcome is how a G2 rollout ends.
type wfOutcome struct {
	status   string // success, failure, cancelled
	errMsg   string
	category string
}

func (o *wfOutcome) failed(category, format string, args ...any) {
	o.status, o.category, o.errMsg = "failure", category, fmt.Sprintf(format, args...)
}

// runWorkflow takes a G2 rollout from the queue to its callbacks.
func (s *Service) runWorkflow(rec *record) {
	log := s.log.With("rollout_id", rec.id)
	defer func() {
		if err := rec.log.close(); err != nil {
			log.Warn("event log", "error", err)
		}
	}()
	out := s.execute(rec, log)
	// The status a trainer reads when a callback arrives already says what
	// the callback says: final, or grading.
	grading := out.status == "success" && s.gradingApplies(rec)
	if grading {
		rec.setState(rolloutv1.State_STATE_GRADING)
	} else {
		if out.status == "success" {
			rec.log.write("grading_skipped", map[string]any{
				"has_grader": s.cfg.Grader != nil, "has_label": rec.label != nil, "has_metadata": rec.metadata != nil,
			})
		}
		s.markFinal(rec, out)
	}
	s.deliverCompletion(rec, out, log)
	if grading {
		s.gradeSamples(rec, out, log)
		s.markFinal(rec, out)
	}
	s.deliverGrades(rec, out, log)
	s.finishWorkflow(rec, out, log)
}

// gradingApplies: a grader is configured and the row has a label or
// metadata (PROTOCOL.md's gate).
func (s *Service) gradingApplies(rec *record) bool {
	return s.cfg.Grader != nil && (rec.label != nil || rec.metadata != nil)
}

// agentDeadline is when the workflow must be done: agent_timeout_sec (or
// the server's RolloutTimeout) counted from acceptance, so time spent
// queued comes out of the budget.
func (s *Service) agentDeadline(rec *record) (time.Time, time.Duration) {
	budget := s.cfg.RolloutTimeout
	if rec.g2.AgentTimeoutSec != nil {
		budget = time.Duration(rec.g2.GetAgentTimeoutSec() * float64(time.Second))
	}
	return rec.created.Add(budget), budget
}

// execute queues for a slot and runs the workflow. It returns the outcome
// with the samples collected into rec.
func (s *Service) execute(rec *record, log *slog.Logger) *wfOutcome {
	out := &wfOutcome{status: "success"}
	deadline, budget := s.agentDeadline(rec)
	ctx, cancel := context.WithDeadline(rec.traced(rec.runCtx), deadline)
	defer cancel()

	queued := time.Now()
	release, err := s.acquire(ctx)
	s.queuedG2.Add(-1)
	s.metrics.queued.Dec()
	if err != nil {
		switch {
		case errors.Is(context.Cause(rec.runCtx), errCancelled):
			out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "cancelled by request while queued"
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			out.failed(categoryTimeout, "agent_timeout_sec (%s) ran out while the rollout was queued", budget)
		default:
			out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "server shutting down before the rollout started"
		}
		return out
	}
	if !rec.startRunning() {
		// Cancelled while the slot was being handed over.
		release()
		out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "cancelled by request while queued"
		return out
	}
	rec.rolloutSpan().AddEvent("started", trace.WithAttributes(osmoattr.QueueWait.Float64(ms(time.Since(queued)))))
	s.runningG2.Add(1)
	s.metrics.running.Inc()
	rec.log.write("start", map[string]any{"queued_ms": ms(time.Since(queued))})

	s.routes.Set(rec.id, llmproxy.Route{
		BaseURL:     strings.TrimRight(rec.g2.GetChatCompletionsUrl(), "/"),
		APIKey:      rec.g2.GetControllerApiKey(),
		Model:       s.cfg.Model,
		PinModel:    true,
		ClientToken: rec.token,
		Context:     ctx,
	})
	r := osmo.NewRollout(rec.id, &workflowRuntime{s: s, rec: rec, log: log})
	agentCtx, span := s.startSpan(ctx, "invoke_agent "+rec.workflow, trace.SpanKindInternal,
		semconv.GenAIOperationNameInvokeAgent, semconv.GenAIAgentName(rec.workflow))
	done := make(chan error, 1)
	go func() {
		done <- s.cfg.Workflow.Run(agentCtx, r, &osmo.WorkflowInput{
			RolloutID: rec.id,
			Prompt:    fromStructs(rec.g2.GetInitialMessages()),
			Metadata:  metadataMap(rec.g2.GetMetadata()),
		})
	}()
	var runErr error
	abandoned := false
	select {
	case runErr = <-done:
	case <-agentCtx.Done():
		t := time.NewTimer(workflowGrace)
		select {
		case runErr = <-done:
		case <-t.C:
			abandoned = true
			runErr = fmt.Errorf("workflow did not return within %s of its context ending (abandoned): %w", workflowGrace, context.Cause(agentCtx))
		}
		t.Stop()
	}
	s.routes.Delete(rec.id)
	finish := func() {
		release()
		s.runningG2.Add(-1)
		s.metrics.running.Dec()
	}
	if abandoned {
		// The slot stays taken until the workflow really returns, so the
		// limit bounds what actually runs.
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			<-done
			finish()
		}()
		log.Error("workflow ignores its context; abandoned it", "grace", workflowGrace)
	} else {
		finish()
	}

	if runErr == nil && errors.Is(context.Cause(rec.runCtx), errCancelled) {
		// It returned after being cancelled: the trainer was told
		// cancelled_running, and the result is not waited for.
		out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "cancelled by request"
	}
	if runErr != nil {
		s.classify(rec, ctx, runErr, budget, out)
		var p *osmo.PanicError
		if errors.As(runErr, &p) {
			log.Error("workflow panicked", "panic", p.Value, "stack", string(p.Stack))
		}
	}
	// Samples are collected even from a failed run: whatever the agent
	// recorded is kept and reported.
	if err := s.collectSamples(rec, r); err != nil && out.status == "success" {
		out.failed(categoryAgent, "%v", err)
	}
	if out.status != "success" {
		fail(span, out.category, out.errMsg)
		log.WarnContext(agentCtx, "workflow failed", "category", out.category, "error", out.errMsg)
	}
	span.End()
	return out
}

// acquire takes the workflow's concurrency slot (if it has a limit) and the
// server's, in that order, or fails when ctx ends.
func (s *Service) acquire(ctx context.Context) (release func(), err error) {
	if s.wfSem != nil {
		select {
		case s.wfSem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		if s.wfSem != nil {
			<-s.wfSem
		}
		return nil, ctx.Err()
	}
	return func() {
		<-s.sem
		if s.wfSem != nil {
			<-s.wfSem
		}
	}, nil
}

// classify maps a workflow error to its G2 category.
func (s *Service) classify(rec *record, ctx context.Context, err error, budget time.Duration, out *wfOutcome) {
	switch {
	case errors.Is(context.Cause(rec.runCtx), errCancelled):
		out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "cancelled by request: "+err.Error()
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		out.failed(categoryTimeout, "workflow did not finish within agent_timeout_sec (%s): %v", budget, err)
	case rec.runCtx.Err() != nil:
		out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "server shutting down: "+err.Error()
	case errors.Is(err, osmo.ErrInvalidInput):
		out.failed(categoryValidation, "%v", err)
	case s.lastCallFailedUpstream(rec):
		out.failed(categoryHTTP, "%v", err)
	default:
		out.failed(categoryAgent, "%v", err)
	}
}

// lastCallFailedUpstream reports whether the rollout's last LLM call failed
// with an HTTP error from the policy: the likely cause of the failure.
func (s *Service) lastCallFailedUpstream(rec *record) bool {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.calls) == 0 {
		return false
	}
	c := rec.calls[len(rec.calls)-1]
	return c.Err != "" && c.StatusCode >= 400
}

// collectSamples asks every registered source for its sample.
func (s *Service) collectSamples(rec *record, r *osmo.Rollout) error {
	var errs []error
	var samples []*rolloutv1.RolloutSample
	for _, src := range r.Sources() {
		msgs, extra, err := sourceSample(src.Source)
		rec.mu.Lock()
		calls, started := rec.callsOf(src.ID), rec.started
		rec.mu.Unlock()
		if err == nil && msgs == nil {
			msgs = recordedConversation(calls)
		}
		if err == nil && len(msgs) == 0 {
			err = errors.New("no messages: the source returned none and no LLM call was recorded for it")
		}
		sample := &rolloutv1.RolloutSample{
			RolloutId: rec.id,
			Id:        src.ID,
			Label:     rec.label,
			Metadata:  rec.metadata,
			Workflow:  rec.workflow,
			LlmCalls:  make([]*rolloutv1.LLMCall, 0, len(calls)),
		}
		for _, c := range calls {
			sample.LlmCalls = append(sample.LlmCalls, callProto(c))
		}
		sample.Metrics = sampleMetrics(calls, started)
		if err == nil {
			structs, cerr := toStructs(msgs)
			if cerr != nil {
				err = fmt.Errorf("messages are not JSON objects: %w", cerr)
			}
			sample.Messages = structs
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("sample %q: %w", src.ID, err))
		}
		fields := mergeExtra(rec.g2.GetExtraFields(), extra)
		if len(fields) > 0 {
			if e, err := structpb.NewStruct(jsonRoundTrip(fields)); err == nil {
				sample.ExtraFields = e
			}
		}
		samples = append(samples, sample)
	}
	rec.mu.Lock()
	rec.samples = samples
	rec.mu.Unlock()
	return errors.Join(errs...)
}

// sourceSample reads a source, turning a panic into an error.
func sourceSample(src osmo.SampleSource) (msgs []osmo.Message, extra map[string]any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("sample source panicked: %v", p)
		}
	}()
	msgs, err = src.SampleMessages()
	if x, ok := src.(osmo.SampleExtras); ok {
		extra = x.SampleExtraFields()
	}
	return msgs, extra, err
}

func mergeExtra(base *structpb.Struct, extra map[string]any) map[string]any {
	if base == nil && len(extra) == 0 {
		return nil
	}
	out := base.AsMap()
	for k, v := range extra {
		out[k] = v
	}
	return out
}

// recordedConversation is the conversation the proxy saw for a sample: the
// last successful call's request messages and its answer.
func recordedConversation(calls []*llmproxy.Call) []osmo.Message {
	for i := len(calls) - 1; i >= 0; i-- {
		c := calls[i]
		if c.Err != "" || len(c.ResponseMessage) == 0 {
			continue
		}
		msgs := fromRaw(c.RequestMessages)
		if m := fromRawObject(c.ResponseMessage); m != nil {
			msgs = append(msgs, m)
		}
		return msgs
	}
	return nil
}

// sampleMetrics sums a sample's calls; its tool calls are the ones the
// policy asked for (the workflow runs them on its own), its latency the
// workflow's run so far.
func sampleMetrics(calls []*llmproxy.Call, started time.Time) *rolloutv1.RolloutMetrics {
	r := &record{calls: calls, started: started}
	m := r.metricsLocked(time.Now())
	for _, c := range calls {
		var resp struct {
			ToolCalls []json.RawMessage `json:"tool_calls"`
		}
		if len(c.ResponseMessage) > 0 && json.Unmarshal(c.ResponseMessage, &resp) == nil {
			m.NumToolCalls += int32(len(resp.ToolCalls))
		}
	}
	return m
}

func metadataMap(s *structpb.Struct) map[string]any {
	if s == nil {
		return nil
	}
	return s.AsMap()
}

// gradeSamples sends the samples to the grader; the caller checked that
// grading applies (gradingApplies).
func (s *Service) gradeSamples(rec *record, out *wfOutcome, log *slog.Logger) {
	budget := s.cfg.GradeTimeout
	if rec.g2.GraderTimeoutSec != nil {
		budget = time.Duration(rec.g2.GetGraderTimeoutSec() * float64(time.Second))
	}
	ctx, cancel := context.WithTimeout(rec.traced(rec.gradeCtx), budget)
	defer cancel()
	ctx, span := s.startSpan(ctx, "grade", trace.SpanKindClient, osmoattr.GraderName.String(s.cfg.GraderName))
	defer span.End()
	rec.mu.Lock()
	samples := rec.samples
	rec.mu.Unlock()
	start := time.Now()
	resp, err := s.cfg.Grader.Grade(ctx, &graderv1.GradeRequest{
		RolloutId: rec.id,
		Samples:   samples,
		Label:     rec.label,
		Metadata:  rec.metadata,
		Grader:    s.cfg.GraderName,
		Timeout:   durationpb.New(budget),
	})
	switch {
	case err != nil && errors.Is(context.Cause(rec.gradeCtx), errCancelled):
		out.status, out.category, out.errMsg = "cancelled", categoryCancelled, "cancelled by request while grading"
	case err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		out.failed(categoryTimeout, "grading did not finish within grader_timeout_sec (%s)", budget)
	case err != nil:
		out.failed(categoryAgent, "grading failed: %v", err)
	case resp.GetError() != "":
		cat := resp.GetErrorCategory()
		if cat == "" {
			cat = categoryAgent
		}
		out.failed(cat, "grading failed: %s", resp.GetError())
	default:
		if msg := checkGrades(rec, resp); msg != "" {
			out.failed(categoryValidation, "grading failed: grader %q %s", resp.GetGrader(), msg)
		}
	}
	if out.status != "success" {
		s.metrics.gradeDuration.WithLabelValues("error").Observe(time.Since(start).Seconds())
		rec.log.write("grade_error", map[string]any{"error": out.errMsg, "category": out.category})
		fail(span, out.category, out.errMsg)
		log.WarnContext(ctx, "grading failed", "category", out.category, "error", out.errMsg)
		return
	}
	s.metrics.gradeDuration.WithLabelValues("ok").Observe(time.Since(start).Seconds())
	grades := map[string]*graderv1.SampleGrade{}
	for _, g := range resp.GetGrades() {
		grades[g.GetSampleId()] = g
	}
	rec.mu.Lock()
	var sum float64
	n := 0
	for _, sm := range rec.samples {
		g := grades[sm.GetId()]
		if g == nil {
			continue
		}
		sm.Reward, sm.RemoveSample = g.Reward, g.GetRemoveSample()
		if g.Reward != nil && !g.GetRemoveSample() {
			sum += g.GetReward()
			n++
		}
	}
	if n > 0 {
		mean := sum / float64(n)
		rec.reward = &mean
	}
	reward := rec.reward
	rec.mu.Unlock()
	if reward != nil && span.IsRecording() && !math.IsNaN(*reward) {
		span.SetAttributes(osmoattr.Reward.Float64(*reward))
	}
	rec.log.write("graded", map[string]any{"reward": reward, "grader": resp.GetGrader(), "duration_ms": ms(time.Since(start))})
	log.InfoContext(ctx, "graded", "reward", reward, "grader", resp.GetGrader())
}

// checkGrades reports what is wrong with a grader's answer, or "": every
// sample needs a grade with a finite reward or remove_sample, and a reward
// present must be finite (JSON cannot carry anything else).
func checkGrades(rec *record, resp *graderv1.GradeResponse) string {
	grades := map[string]*graderv1.SampleGrade{}
	for _, g := range resp.GetGrades() {
		grades[g.GetSampleId()] = g
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var bad []string
	for _, sm := range rec.samples {
		g := grades[sm.GetId()]
		switch {
		case g == nil:
			bad = append(bad, fmt.Sprintf("%q (no grade)", sm.GetId()))
		case g.Reward != nil && (math.IsNaN(g.GetReward()) || math.IsInf(g.GetReward(), 0)):
			bad = append(bad, fmt.Sprintf("%q (non-finite reward %v)", sm.GetId(), g.GetReward()))
		case g.Reward == nil && !g.GetRemoveSample():
			bad = append(bad, fmt.Sprintf("%q (neither a reward nor remove_sample)", sm.GetId()))
		}
	}
	if len(bad) == 0 {
		return ""
	}
	return "left samples without a finite reward: " + strings.Join(bad, ", ")
}

// g2Completion is the G2 completion callback body.
type g2Completion struct {
	Status      string  `json:"status"`
	RolloutID   string  `json:"rollout_id"`
	ErrMessage  *string `json:"err_message"`
	ErrCategory *string `json:"err_category"`
}

// g2GraderCallback is the G2 grader callback body.
type g2GraderCallback struct {
	g2Completion
	Samples map[string]*g2Sample `json:"samples"`
}

// g2Sample is one sample of the grader callback. llm_calls carries the
// per-call records (token ids, logprobs, usage) of the G3 wire.
type g2Sample struct {
	ID           string           `json:"id"`
	Messages     []map[string]any `json:"messages"`
	Label        *string          `json:"label"`
	Reward       *float64         `json:"reward"`
	RemoveSample bool             `json:"remove_sample"`
	Metrics      map[string]any   `json:"metrics"`
	ExtraFields  map[string]any   `json:"extra_fields"`
	LLMCalls     []map[string]any `json:"llm_calls,omitempty"`
}

func (o *wfOutcome) body(rolloutID string) g2Completion {
	c := g2Completion{Status: o.status, RolloutID: rolloutID}
	if o.status != "success" {
		msg, cat := o.errMsg, o.category
		if cat == categoryCancelled {
			// The G2 categories have no "cancelled": the status says it.
			c.ErrMessage = &msg
		} else {
			c.ErrMessage, c.ErrCategory = &msg, &cat
		}
	}
	return c
}

func (s *Service) g2Policy() callbackPolicy {
	return callbackPolicy{
		Retries:   s.cfg.Callbacks.Attempts - 1,
		BaseDelay: s.cfg.Callbacks.BaseDelay,
		MaxDelay:  s.cfg.Callbacks.MaxDelay,
		Timeout:   s.cfg.Callbacks.Timeout,
		Delivered: g2Delivered,
		Retryable: g2Retryable,
	}
}

// deliverCompletion posts the completion callback (once).
func (s *Service) deliverCompletion(rec *record, out *wfOutcome, log *slog.Logger) {
	s.post(rec, "completion", rec.g2.GetCompletionCallbackUrl(), out.body(rec.id), out.status, log)
}

// deliverGrades posts the grader callback (once) when the trainer asked for
// one: the samples with their rewards, or the failure.
func (s *Service) deliverGrades(rec *record, out *wfOutcome, log *slog.Logger) {
	if rec.g2.GraderCallbackUrl == nil {
		return
	}
	body := g2GraderCallback{g2Completion: out.body(rec.id), Samples: map[string]*g2Sample{}}
	rec.mu.Lock()
	for _, sm := range rec.samples {
		body.Samples[sm.GetId()] = wireSample(sm)
	}
	rec.mu.Unlock()
	s.post(rec, "grader", rec.g2.GetGraderCallbackUrl(), body, out.status, log)
}

func wireSample(sm *rolloutv1.RolloutSample) *g2Sample {
	out := &g2Sample{
		ID:           sm.GetId(),
		Messages:     fromStructs(sm.GetMessages()),
		Label:        sm.Label,
		Reward:       sm.Reward,
		RemoveSample: sm.GetRemoveSample(),
		Metrics:      protoMap(sm.GetMetrics()),
		ExtraFields:  sm.GetExtraFields().AsMap(),
	}
	for _, c := range sm.GetLlmCalls() {
		out.LLMCalls = append(out.LLMCalls, wireCall(c))
	}
	return out
}

// wireCall is one record of a grader callback sample's llm_calls: the
// LLMCall with its proto field names, which include the G3 names
// (prompt_tokens, completion_tokens, cached_tokens, model_name) beside
// usage and model. Token ids and logprobs the upstream did not return are
// left out rather than sent as empty arrays, which would read as "no
// tokens".
func wireCall(c *rolloutv1.LLMCall) map[string]any {
	m := protoMap(c)
	for _, k := range [...]string{"prompt_token_ids", "completion_token_ids", "logprobs"} {
		if v, ok := m[k].([]any); ok && len(v) == 0 {
			delete(m, k)
		}
	}
	return m
}

// post delivers one G2 callback under the G2 retry policy; a failure is
// recorded on the rollout (callback_error), never retried beyond it.
func (s *Service) post(rec *record, kind, url string, body any, outcomeStatus string, log *slog.Logger) {
	ctx := rec.traced(context.WithoutCancel(s.rolloutsCtx))
	attempts, err := s.deliver(ctx, kind, url, rec.g2.GetControllerApiKey(), body, outcomeStatus, log)
	fields := map[string]any{"kind": kind, "status": outcomeStatus, "attempts": attempts}
	if err != nil {
		fields["error"] = err.Error()
		rec.mu.Lock()
		if rec.callbackErr != "" {
			rec.callbackErr += "; "
		}
		rec.callbackErr += kind + ": " + err.Error()
		rec.mu.Unlock()
	}
	rec.log.write(kind+"_callback", fields)
}

// deliver posts one G2 callback under the G2 retry policy, in a span of its
// own under ctx, and returns the attempts made.
func (s *Service) deliver(ctx context.Context, kind, url, bearer string, body any, outcomeStatus string, log *slog.Logger) (int, error) {
	cctx, span := s.startSpan(ctx, "deliver_"+kind+"_callback", trace.SpanKindInternal,
		semconv.URLFull(url), osmoattr.RolloutStatus.String(outcomeStatus))
	defer span.End()
	attempts, err := postJSON(cctx, s.g2Client, url, bearer, body, s.g2Policy(), log, s.metrics.callbacks)
	span.SetAttributes(osmoattr.Attempts.Int(attempts))
	if err != nil {
		fail(span, "callback_failed", err.Error())
		log.ErrorContext(cctx, kind+" callback failed", "error", err, "attempts", attempts)
		s.metrics.callbackFails.Inc()
	}
	return attempts, err
}

// markFinal records the outcome as the rollout's state; finished (what
// watchers and finished_at report) waits for the last callback.
func (s *Service) markFinal(rec *record, out *wfOutcome) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	rec.errMsg, rec.errCategory = out.errMsg, out.category
	if out.category == categoryCancelled {
		rec.errCategory = ""
	}
	switch out.status {
	case "success":
		rec.state = rolloutv1.State_STATE_SUCCEEDED
	case "cancelled":
		rec.state = rolloutv1.State_STATE_CANCELLED
	default:
		rec.state = rolloutv1.State_STATE_FAILED
	}
}

// finishWorkflow counts the finished rollout and tells watchers.
func (s *Service) finishWorkflow(rec *record, out *wfOutcome, log *slog.Logger) {
	rec.mu.Lock()
	rec.finished = time.Now()
	reward := rec.reward
	rec.mu.Unlock()
	s.completed.Add(1)
	s.metrics.finished.WithLabelValues(out.status, out.category).Inc()
	s.metrics.duration.WithLabelValues(out.status).Observe(time.Since(rec.created).Seconds())
	if reward != nil {
		s.metrics.rewards.Observe(*reward)
	}
	s.store.finish(rec)
	log.Info("rollout finished", "status", out.status, "category", out.category, "reward", reward)
	endWorkflowSpan(rec.rolloutSpan(), out, reward)
}

// workflowRuntime is the osmo.RolloutRuntime of one G2 rollout.
type workflowRuntime struct {
	s   *Service
	rec *record
	log *slog.Logger
}

func (rt *workflowRuntime) Endpoint(sampleID string) osmo.Endpoint {
	client := rt.s.llmClient
	if rt.s.tracer != nil {
		// Every call through this endpoint is the sample's: its client span
		// and what the proxy starts under it carry osmo.sample.id, as a G1
		// rollout's do, whatever context the workflow calls with.
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
// each request's context before base (the traced transport) starts its
// span, so telemetry.BaggageAttributes tags the span with them and the
// baggage header carries them to the proxy.
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
