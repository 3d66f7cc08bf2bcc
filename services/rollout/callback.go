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
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// completion is the G1 body of POST {server_url}/v1/rollout/completed.
// Fields that are None in the Osmosis server are omitted.
type completion struct {
	RolloutID     string           `json:"rollout_id"`
	Status        string           `json:"status"`
	FinalMessages []map[string]any `json:"final_messages"`
	FinishReason  string           `json:"finish_reason,omitempty"`
	ErrorMessage  string           `json:"error_message,omitempty"`
	Reward        *float64         `json:"reward,omitempty"`
	ExtraFields   map[string]any   `json:"extra_fields,omitempty"`
	Metrics       *completionStats `json:"metrics,omitempty"`
}

type completionStats struct {
	TotalLatencyMS   float64 `json:"total_latency_ms"`
	LLMLatencyMS     float64 `json:"llm_latency_ms"`
	ToolLatencyMS    float64 `json:"tool_latency_ms"`
	NumLLMCalls      int     `json:"num_llm_calls"`
	NumToolCalls     int     `json:"num_tool_calls"`
	PromptTokens     int     `json:"prompt_tokens"`
	ResponseTokens   int     `json:"response_tokens"`
	MaxContextTokens int     `json:"max_context_tokens"`
}

// callbackPolicy is the G1 completion retry rule: only a 200 counts, a 4xx
// (or any other non-200 below 500) fails at once, a 5xx or transport error is
// retried Retries times with delay BaseDelay*2^attempt capped at MaxDelay.
type callbackPolicy struct {
	Retries   int
	BaseDelay time.Duration
	MaxDelay  time.Duration
	Timeout   time.Duration
	// Delivered and Retryable classify an answer's status; nil means the G1
	// rule (only 200 delivers, 5xx is retried).
	Delivered func(code int) bool
	Retryable func(code int) bool
}

// g1Delivered and g1Retryable are the G1 completion rule.
func g1Delivered(code int) bool { return code == http.StatusOK }
func g1Retryable(code int) bool { return code >= 500 }

// g2Delivered and g2Retryable are the G2 callback rule: any 2xx delivers;
// 429, 500, 502, 503 and 504 are retried.
func g2Delivered(code int) bool { return code >= 200 && code <= 299 }
func g2Retryable(code int) bool {
	switch code {
	case http.StatusTooManyRequests, http.StatusInternalServerError, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

func (p callbackPolicy) delay(attempt int) time.Duration {
	d := p.BaseDelay
	for i := 0; i < attempt && d < p.MaxDelay; i++ {
		d *= 2
	}
	return min(d, p.MaxDelay)
}

// errPermanent marks a callback failure that retrying cannot fix.
var errPermanent = errors.New("not retried")

// postJSON delivers body to url under policy and returns the attempts made.
// attempts counts each attempt by outcome (ok, retry, failed). A failed
// attempt is an event on the span in ctx (each attempt is a client span of
// its own when the client is traced).
func postJSON(ctx context.Context, client *http.Client, url, bearer string, body any, p callbackPolicy, log *slog.Logger, attempts *prometheus.CounterVec) (int, error) {
	payload, err := json.Marshal(body)
	if err != nil {
		return 0, fmt.Errorf("encode callback: %w", err)
	}
	var lastErr error
	for attempt := 0; attempt <= p.Retries; attempt++ {
		if attempt > 0 {
			t := time.NewTimer(p.delay(attempt - 1))
			select {
			case <-ctx.Done():
				t.Stop()
				return attempt, fmt.Errorf("callback to %s: %w (last error: %v)", url, ctx.Err(), lastErr)
			case <-t.C:
			}
		}
		lastErr = p.postOnce(ctx, client, url, bearer, payload)
		if lastErr == nil {
			attempts.WithLabelValues("ok").Inc()
			return attempt + 1, nil
		}
		log.WarnContext(ctx, "callback attempt failed", "url", url, "attempt", attempt+1, "error", lastErr)
		retry := !errors.Is(lastErr, errPermanent) && attempt < p.Retries
		if span := trace.SpanFromContext(ctx); span.IsRecording() {
			span.AddEvent("attempt_failed", trace.WithAttributes(
				osmoattr.Attempt.Int(attempt+1),
				attribute.Bool("osmo.retry", retry),
				semconv.ExceptionMessage(lastErr.Error()),
			))
		}
		if errors.Is(lastErr, errPermanent) || attempt == p.Retries {
			attempts.WithLabelValues("failed").Inc()
		} else {
			attempts.WithLabelValues("retry").Inc()
		}
		if errors.Is(lastErr, errPermanent) {
			return attempt + 1, fmt.Errorf("callback to %s: %w", url, lastErr)
		}
	}
	return p.Retries + 1, fmt.Errorf("callback to %s failed after %d attempts: %w", url, p.Retries+1, lastErr)
}

func (p callbackPolicy) postOnce(ctx context.Context, client *http.Client, url, bearer string, payload []byte) error {
	if p.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, p.Timeout)
		defer cancel()
	}
	delivered, retryable := p.Delivered, p.Retryable
	if delivered == nil {
		delivered, retryable = g1Delivered, g1Retryable
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
	case delivered(resp.StatusCode):
		return nil
	case retryable(resp.StatusCode):
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(snippet))
	default:
		return fmt.Errorf("%w: HTTP %d: %s", errPermanent, resp.StatusCode, bytes.TrimSpace(snippet))
	}
}
