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
	body   any
	// status is the status word the body carries, for the span and log.
	status string
	policy callbackPolicy
}

// deliver posts a rollout's callbacks in order. A callback that cannot be
// delivered under its policy is recorded on the rollout (callback_error),
// logged and counted; the next one is still posted.
func (s *Service) deliver(rec *record, ds []delivery, log *slog.Logger) {
	// The callbacks are owed even when the rollout was cancelled or the
	// server is shutting down.
	ctx := rec.traced(s.deliverCtx)
	for _, d := range ds {
		attempts, err := s.post(ctx, d, log)
		fields := map[string]any{"status": d.status, "attempts": attempts}
		if err != nil {
			fields["error"] = err.Error()
			rec.addCallbackError(d.event, err)
		}
		rec.log.write(d.event, fields)
	}
}

// post delivers one callback under its policy, in a span of its own under
// ctx, and returns the attempts made.
func (s *Service) post(ctx context.Context, d delivery, log *slog.Logger) (int, error) {
	ctx, span := s.startSpan(ctx, "deliver_"+d.event, trace.SpanKindInternal,
		semconv.URLFull(d.url), osmoattr.RolloutStatus.String(d.status))
	defer span.End()
	attempts, err := postJSON(context.WithValue(ctx, attemptRouteKey{}, d.route), s.callbackClient, d, log, s.metrics.callbacks)
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

// postJSON delivers d and returns the attempts made. attempts counts each
// attempt by outcome (ok, retry, failed). A failed attempt is an event on
// the span in ctx (each attempt is a client span of its own when the client
// is traced). When ctx ends the delivery stops where it is.
func postJSON(ctx context.Context, client *http.Client, d delivery, log *slog.Logger, attempts *prometheus.CounterVec) (int, error) {
	payload, err := json.Marshal(d.body)
	if err != nil {
		return 0, fmt.Errorf("encode callback: %w", err)
	}
	p := d.policy
	giveUp := time.Now().Add(p.Deadline)
	for attempt := 1; ; attempt++ {
		err := p.postOnce(ctx, client, d.url, d.bearer, payload)
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

func (p callbackPolicy) postOnce(ctx context.Context, client *http.Client, url, bearer string, payload []byte) error {
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
	resp, err := client.Do(req)
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
