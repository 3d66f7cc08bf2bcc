package otlpdirect

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/osmo-rl/osmo/internal/retry"
	"google.golang.org/protobuf/encoding/protowire"
)

// RetryConfig is the exponential backoff of failed exports, as in the
// OpenTelemetry OTLP exporters.
type RetryConfig struct {
	// Disabled turns retries off.
	Disabled bool
	// InitialInterval is the wait before the first retry (5s), doubled for
	// each next one up to MaxInterval (30s), with jitter; a collector's
	// Retry-After (HTTP) or RetryInfo (gRPC) wins. Retries stop at
	// MaxElapsedTime (1m) or when the export's context ends.
	InitialInterval, MaxInterval, MaxElapsedTime time.Duration
}

func (c RetryConfig) withDefaults() RetryConfig {
	if c.InitialInterval <= 0 {
		c.InitialInterval = 5 * time.Second
	}
	if c.MaxInterval <= 0 {
		c.MaxInterval = 30 * time.Second
	}
	if c.MaxElapsedTime <= 0 {
		c.MaxElapsedTime = time.Minute
	}
	return c
}

// retryable is an export failure worth trying again, after Wait when the
// collector said how long.
type retryable struct {
	err  error
	wait time.Duration
}

func (r *retryable) Error() string { return r.err.Error() }
func (r *retryable) Unwrap() error { return r.err }

// withRetries runs attempt until it succeeds, fails for good, or the
// retry budget or ctx runs out.
func withRetries(ctx context.Context, rc RetryConfig, attempt func(context.Context) error) error {
	start := time.Now()
	// Jitter of ±50%, as the OTLP exporters' backoff has.
	b := retry.Doubling(rc.InitialInterval, rc.MaxInterval, 0.5)
	var prev error // the last attempt's failure
	for {
		err := attempt(ctx)
		if err != nil && prev != nil && ctx.Err() != nil {
			// Cut short by ctx: the answer before says more than the cut.
			return fmt.Errorf("%w (retry abandoned: %w)", prev, context.Cause(ctx))
		}
		prev = err
		var r *retryable
		if err == nil || rc.Disabled || !errors.As(err, &r) {
			return err
		}
		// The collector's word wins, and leaves the schedule where it was.
		wait := r.wait
		if wait <= 0 {
			wait = b.NextBackOff()
		}
		if time.Since(start)+wait > rc.MaxElapsedTime {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (retry abandoned: %w)", err, context.Cause(ctx))
		case <-t.C:
		}
	}
}

// HTTPConfig configures an OTLP/HTTP exporter.
type HTTPConfig struct {
	// URL is where requests are posted, the signal path included
	// (http://collector:4318/v1/traces).
	URL string
	// Headers are added to every request.
	Headers map[string]string
	// Gzip compresses the requests.
	Gzip bool
	// TLS configures https (nil: the system's roots).
	TLS *tls.Config
	// Timeout bounds one attempt (10s).
	Timeout time.Duration
	Retry   RetryConfig
}

// HTTPExporter posts encoded requests as application/x-protobuf.
type HTTPExporter struct {
	cfg    HTTPConfig
	client *http.Client
	gz     sync.Pool // *gzip.Writer
	bufs   sync.Pool // *bytes.Buffer: compressed requests
}

// NewHTTPExporter makes an OTLP/HTTP exporter; it connects on the first
// export.
func NewHTTPExporter(cfg HTTPConfig) *HTTPExporter {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	cfg.Retry = cfg.Retry.withDefaults()
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if cfg.TLS != nil {
		tr.TLSClientConfig = cfg.TLS
	}
	return &HTTPExporter{cfg: cfg, client: &http.Client{Transport: tr}}
}

// Export posts request, retrying 429, 502, 503 and 504 answers and
// connection failures; a 200 answer's partial success is an error when it
// rejected spans.
func (e *HTTPExporter) Export(ctx context.Context, request []byte) error {
	body := request
	if e.cfg.Gzip {
		buf, _ := e.bufs.Get().(*bytes.Buffer)
		if buf == nil {
			buf = new(bytes.Buffer)
		}
		defer e.bufs.Put(buf)
		buf.Reset()
		zw, _ := e.gz.Get().(*gzip.Writer)
		if zw == nil {
			zw = gzip.NewWriter(buf)
		} else {
			zw.Reset(buf)
		}
		_, _ = zw.Write(request)
		if err := zw.Close(); err != nil {
			return err
		}
		e.gz.Put(zw)
		body = buf.Bytes()
	}
	return withRetries(ctx, e.cfg.Retry, func(ctx context.Context) error {
		return e.post(ctx, body)
	})
}

func (e *HTTPExporter) post(ctx context.Context, body []byte) error {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.cfg.URL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	for k, v := range e.cfg.Headers {
		req.Header.Set(k, v)
	}
	req.Header.Set("Content-Type", "application/x-protobuf")
	req.Header.Set("User-Agent", userAgent)
	if e.cfg.Gzip {
		req.Header.Set("Content-Encoding", "gzip")
	}
	resp, err := e.client.Do(req)
	if err != nil {
		if ctx.Err() != nil && context.Cause(ctx) != context.DeadlineExceeded {
			return err // the export's own context ended
		}
		return &retryable{err: err}
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil && resp.StatusCode/100 == 2 {
		return &retryable{err: err}
	}
	switch {
	case resp.StatusCode/100 == 2:
		return partialSuccess(answer)
	case resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode == http.StatusBadGateway,
		resp.StatusCode == http.StatusServiceUnavailable, resp.StatusCode == http.StatusGatewayTimeout:
		return &retryable{err: httpStatusError(e.cfg.URL, resp.Status, answer), wait: retryAfter(resp.Header.Get("Retry-After"))}
	}
	return httpStatusError(e.cfg.URL, resp.Status, answer)
}

func httpStatusError(url, status string, body []byte) error {
	if len(body) > 512 {
		body = body[:512]
	}
	return fmt.Errorf("%s answered %s: %q", url, status, body)
}

// retryAfter reads a Retry-After header: seconds or an HTTP date.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(v); err == nil && s >= 0 {
		return time.Duration(min(s, 3600)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(0, time.Until(t))
	}
	return 0
}

// partialSuccess reads an ExportTraceServiceResponse: an error when its
// partial_success (1) rejected spans (1) or carries a message (2).
func partialSuccess(resp []byte) error {
	var rejected uint64
	var msg string
	for len(resp) > 0 {
		num, typ, n := protowire.ConsumeTag(resp)
		if n < 0 {
			return nil // not protobuf: a collector that answers 200 with text
		}
		resp = resp[n:]
		if num == 1 && typ == protowire.BytesType {
			ps, n := protowire.ConsumeBytes(resp)
			if n < 0 {
				return nil
			}
			resp = resp[n:]
			for len(ps) > 0 {
				num, typ, n := protowire.ConsumeTag(ps)
				if n < 0 {
					return nil
				}
				ps = ps[n:]
				switch {
				case num == 1 && typ == protowire.VarintType:
					rejected, n = protowire.ConsumeVarint(ps)
				case num == 2 && typ == protowire.BytesType:
					var b []byte
					b, n = protowire.ConsumeBytes(ps)
					msg = string(b)
				default:
					n = protowire.ConsumeFieldValue(num, typ, ps)
				}
				if n < 0 {
					return nil
				}
				ps = ps[n:]
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, resp)
		if n < 0 {
			return nil
		}
		resp = resp[n:]
	}
	if rejected > 0 || msg != "" {
		return fmt.Errorf("collector rejected %d spans: %s", rejected, msg)
	}
	return nil
}

// Shutdown closes idle connections.
func (e *HTTPExporter) Shutdown(context.Context) error {
	e.client.CloseIdleConnections()
	return nil
}

const userAgent = "osmo-otlpdirect"

// Discard is an Exporter that drops every request. Benchmarks put it
// behind the pipeline to measure what tracing costs the traced process,
// without a collector's cost mixed in.
func Discard() Exporter { return discard{} }

type discard struct{}

func (discard) Export(context.Context, []byte) error { return nil }
func (discard) Shutdown(context.Context) error       { return nil }
