package rollout

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// delivery is one callback a wire owes the trainer.
type delivery struct {
	// event names it in the rollout's event log ("completion",
	// "completion_callback", "grader_callback"); its span is
	// "deliver_"+event.
	event string
	// route names its HTTP attempts' spans ("POST "+route): the URL's
	// fixed part, never the URL itself.
	route  string
	url    string
	bearer string
	// body is encoded to payload when the delivery is due; a delivery
	// read back from the state log has its payload only.
	body    any
	payload []byte
	// status is the status word the body carries, for the span and log.
	status string
	policy callbackPolicy
}

// deliver posts the callbacks a rollout owes at stage (stageRan or
// stageFinal, o being the outcome they report) in order: owe, then
// redeliver.
func (s *Service) deliver(rec *record, stage string, o outcome.Outcome, ds []delivery, log *slog.Logger) {
	s.owe(rec, stage, o, ds, log)
	s.redeliver(rec, stage, ds, nil, log)
}

// owe encodes the callbacks a rollout owes at stage and writes them to the
// state log, before the first is posted; redeliver marks each there once it
// is done with, so a restart redelivers exactly those not done.
func (s *Service) owe(rec *record, stage string, o outcome.Outcome, ds []delivery, log *slog.Logger) {
	for i := range ds {
		if ds[i].payload == nil {
			payload, err := json.Marshal(ds[i].body)
			if err != nil {
				// Not expected: every body is built from JSON-able parts.
				payload = []byte(`{}`)
				log.Error("encode callback", "event", ds[i].event, "error", err)
			}
			ds[i].payload = payload
		}
	}
	if err := s.state.owed(rec, stage, o, ds); err != nil {
		log.Error("state log: could not record the callbacks owed; delivering them without", "error", err)
	}
}

// redeliver posts those of ds not yet done (every one when done is nil),
// in order, and marks each in the state log once done with: delivered,
// refused for good, or given up on at the deadline. One stopped by the
// shutdown is left owed, for the next start to deliver. A callback that
// cannot be delivered under its policy is recorded on the rollout
// (callback_error), logged and counted; the next one is still posted.
func (s *Service) redeliver(rec *record, stage string, ds []delivery, done []bool, log *slog.Logger) {
	// The callbacks are owed even when the rollout was cancelled or the
	// server is shutting down.
	ctx := rec.traced(s.deliverCtx)
	for i, d := range ds {
		if i < len(done) && done[i] {
			continue
		}
		attempts, err := s.post(ctx, d, log)
		fields := map[string]any{"status": d.status, "attempts": attempts}
		if err != nil {
			fields["error"] = err.Error()
			rec.addCallbackError(d.event, err)
		}
		rec.log.write(d.event, fields)
		if err != nil && s.deliverCtx.Err() != nil {
			rec.mu.Lock()
			rec.undelivered = true
			rec.mu.Unlock()
			continue
		}
		if err := s.state.delivered(rec.id, stage, i); err != nil {
			log.Error("state log: could not mark a callback done", "event", d.event, "error", err)
		}
	}
}

// post delivers one callback under its policy, in a span of its own under
// ctx, and returns the attempts made.
func (s *Service) post(ctx context.Context, d delivery, log *slog.Logger) (int, error) {
	ctx, span := s.startSpan(ctx, "deliver_"+d.event, trace.SpanKindInternal,
		semconv.URLFull(d.url), osmoattr.RolloutStatus.String(d.status))
	defer span.End()
	attempts, err := s.sender.post(context.WithValue(ctx, attemptRouteKey{}, d.route), d, log)
	span.SetAttributes(osmoattr.Attempts.Int(attempts))
	if err != nil {
		fail(span, "callback_failed", err.Error())
		log.ErrorContext(ctx, d.event+" failed", "error", err, "attempts", attempts)
		s.metrics.callbackFails.Inc()
	}
	return attempts, err
}

// attemptRouteKey carries a delivery's route to the span of each attempt.
type attemptRouteKey struct{}

// attemptSpanName names a callback attempt's client span after its route.
func attemptSpanName(r *http.Request) string {
	if route, ok := r.Context().Value(attemptRouteKey{}).(string); ok {
		return "POST " + route
	}
	return "POST callback"
}

// callbackPolicy is a wire's retry rule for its callbacks: Delivered says
// which answers count, Retryable which are worth another attempt (the rest
// fail at once); a transport error is always retried. An attempt is
// bounded by Timeout. Attempts go on, BaseDelay doubling up to MaxDelay
// apart with jitter, until Deadline after the first: a trainer that
// restarts, or a network that drops for minutes, loses nothing, and one
// that refuses a callback for good is not asked again.
type callbackPolicy struct {
	BaseDelay time.Duration
	MaxDelay  time.Duration
	Timeout   time.Duration
	Deadline  time.Duration
	Delivered func(code int) bool
	Retryable func(code int) bool
}

// g1Delivered and g1Retryable are the G1 completion rule: only a 200
// counts, a 5xx is retried.
func g1Delivered(code int) bool { return code == http.StatusOK }
func g1Retryable(code int) bool { return code >= 500 }

// g2Delivered and g2Retryable are the G2 and v0.3 callback rule: any 2xx
// delivers; 429, 500, 502, 503 and 504 are retried.
func g2Delivered(code int) bool { return code >= 200 && code <= 299 }
func g2Retryable(code int) bool {
	switch code {
	case http.StatusTooManyRequests, http.StatusInternalServerError, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// delay is the wait before attempt (from 1): BaseDelay*2^(attempt-1)
// capped at MaxDelay, of which a random half is taken off, so the
// deliveries of many rollouts that failed together do not retry together.
func (p callbackPolicy) delay(attempt int) time.Duration {
	d := p.BaseDelay
	for i := 1; i < attempt && d < p.MaxDelay; i++ {
		d *= 2
	}
	d = min(d, p.MaxDelay)
	return d/2 + rand.N(d/2+1)
}

// errPermanent marks a callback failure that retrying cannot fix.
var errPermanent = errors.New("not retried")

// sender posts callbacks with client, at most cap(slots) requests at once
// (every trainer together): a burst of results, thousands of rollouts
// cancelled or released together, reaches the trainer at a pace it can
// answer rather than all at once, and an attempt's timeout runs from when
// it is sent, not while it waits its turn, so waiting never turns into a
// retry of a callback the trainer may have taken. attempts counts each
// attempt by outcome (ok, retry, failed).
type sender struct {
	client   *http.Client
	slots    chan struct{}
	attempts *prometheus.CounterVec
}

// post delivers d and returns the attempts made. A failed attempt is an
// event on the span in ctx (each attempt is a client span of its own when
// the client is traced). When ctx ends the delivery stops where it is.
func (c *sender) post(ctx context.Context, d delivery, log *slog.Logger) (int, error) {
	attempts := c.attempts
	payload := d.payload
	if payload == nil {
		var err error
		if payload, err = json.Marshal(d.body); err != nil {
			return 0, fmt.Errorf("encode callback: %w", err)
		}
	}
	p := d.policy
	giveUp := time.Now().Add(p.Deadline)
	for attempt := 1; ; attempt++ {
		err := c.postOnce(ctx, p, d.url, d.bearer, payload)
		if err == nil {
			attempts.WithLabelValues("ok").Inc()
			return attempt, nil
		}
		wait := p.delay(attempt)
		permanent := errors.Is(err, errPermanent)
		retry := !permanent && ctx.Err() == nil && time.Now().Add(wait).Before(giveUp)
		log.WarnContext(ctx, "callback attempt failed", "url", d.url, "attempt", attempt, "retry", retry, "error", err)
		if span := trace.SpanFromContext(ctx); span.IsRecording() {
			span.AddEvent("attempt_failed", trace.WithAttributes(
				osmoattr.Attempt.Int(attempt),
				attribute.Bool("osmo.retry", retry),
				semconv.ExceptionMessage(err.Error()),
			))
		}
		if !retry {
			attempts.WithLabelValues("failed").Inc()
			switch {
			case permanent:
				return attempt, fmt.Errorf("callback to %s: %w", d.url, err)
			case ctx.Err() != nil:
				return attempt, fmt.Errorf("callback to %s: stopped after %d attempts (%v): %w", d.url, attempt, context.Cause(ctx), err)
			}
			return attempt, fmt.Errorf("callback to %s: gave up after %d attempts over the delivery deadline (%s): %w", d.url, attempt, p.Deadline, err)
		}
		attempts.WithLabelValues("retry").Inc()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			attempts.WithLabelValues("failed").Inc()
			return attempt, fmt.Errorf("callback to %s: stopped after %d attempts (%v): %w", d.url, attempt, context.Cause(ctx), err)
		case <-t.C:
		}
	}
}

func (c *sender) postOnce(ctx context.Context, p callbackPolicy, url, bearer string, payload []byte) error {
	select {
	case c.slots <- struct{}{}:
		defer func() { <-c.slots }()
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	if p.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.Timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	if err != nil {
		return fmt.Errorf("%w: build request: %v", errPermanent, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	switch {
	case p.Delivered(resp.StatusCode):
		return nil
	case p.Retryable(resp.StatusCode):
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(snippet))
	default:
		return fmt.Errorf("%w: HTTP %d: %s", errPermanent, resp.StatusCode, bytes.TrimSpace(snippet))
	}
}
