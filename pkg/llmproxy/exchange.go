package llmproxy

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
)

// exchange is one chat completion passing through the proxy.
type exchange struct {
	p     *Proxy
	w     http.ResponseWriter
	r     *http.Request
	ctx   context.Context // r's context, with the client's trace context when traced
	start time.Time
	route Route
	call  *osmo.LLMCall
	req   chatRequest

	// upstream is the time spent waiting on the upstream, backoff the time
	// spent between attempts; the rest of the wall time is the proxy's own.
	upstream time.Duration
	backoff  time.Duration

	// span is the GenAI span of the upstream call (nil when not traced);
	// errType is error.type of a failed call.
	span    trace.Span
	errType string

	// resp is set for a Responses API call, whose answer is translated.
	resp *responsesCall

	// asked are the token members the body going upstream added (nil when
	// it asks for none); policy names the upstream for the refusals;
	// refusal is why the upstream refused them on this call, refused why
	// it did on an earlier one (and this call asks for none).
	asked   []string
	policy  upstreamKey
	refusal string
	refused string

	// engines is set when the call goes over the policy engines; session
	// is its sample's affinity key, tried the engines of its attempts in
	// order, home the engine of its sample's first call ("" for that call).
	engines     *Engines
	budgetSpent bool // a retry was refused: the engines' retry budget was spent
	session     string
	tried       []*engine
	home        string
	// answering, when set, is called once an attempt's answer began (its
	// headers came): from then on its engine leaving the ring no longer
	// cuts it.
	answering func()

	// held is the time spent at the pause gate; versioned is set once an
	// attempt got past it.
	held      time.Duration
	versioned bool
}

// serve handles one call of the given API; idSource says where a missing
// rollout id was expected, for the error message.
func (p *Proxy) serve(w http.ResponseWriter, r *http.Request, api, rolloutID, sampleID, idSource string) {
	x := &exchange{p: p, w: w, r: r, ctx: r.Context(), start: time.Now()}
	if p.tracing != nil {
		x.ctx = p.tracing.traceContext(r)
	}
	x.call = &osmo.LLMCall{RolloutID: rolloutID, SampleID: sampleID, API: api, StartedAt: x.start}
	x.serve(idSource)
	if p.tracing != nil && x.span == nil {
		p.traceRejected(x.ctx, r, x.start, x.call.StatusCode, rolloutID, sampleID)
	}
	x.finish()
}

func (x *exchange) serve(idSource string) {
	p, c := x.p, x.call
	if c.RolloutID == "" {
		x.fail(http.StatusBadRequest, "missing_rollout_id", HeaderRolloutID,
			"llmproxy: missing rollout id ("+idSource+"); set the "+HeaderRolloutID+" header or use the base URL /r/{rollout_id}/s/{sample_id}/v1")
		return
	}
	// Ids travel upstream as header values; refuse what cannot.
	if !validHeaderValue(c.RolloutID) {
		x.fail(http.StatusBadRequest, "invalid_rollout_id", HeaderRolloutID, "llmproxy: rollout id contains control characters")
		return
	}
	if !validHeaderValue(c.SampleID) {
		x.fail(http.StatusBadRequest, "invalid_sample_id", HeaderSampleID, "llmproxy: sample id contains control characters")
		return
	}
	if p.requireSampleID && c.SampleID == "" {
		x.fail(http.StatusBadRequest, "missing_sample_id", HeaderSampleID,
			"llmproxy: missing sample id; set the "+HeaderSampleID+" header or use the base URL /r/{rollout_id}/s/{sample_id}/v1")
		return
	}
	route, ok := p.router.Route(c.RolloutID)
	if !ok {
		x.fail(http.StatusNotFound, "unknown_rollout", HeaderRolloutID, fmt.Sprintf("llmproxy: unknown rollout %q", c.RolloutID))
		return
	}
	x.route = route
	if p.engines != nil && (route.BaseURL == "" || p.enginesOwnRouting) {
		x.engines = p.engines
		x.session = sessionKey(c.RolloutID, c.SampleID)
	}
	if route.ClientToken != "" && !bearerMatches(x.r.Header.Get("Authorization"), route.ClientToken) {
		x.fail(http.StatusUnauthorized, "invalid_api_key", "Authorization",
			"llmproxy: missing or invalid bearer token for rollout "+strconv.Quote(c.RolloutID))
		return
	}
	if route.Context != nil && route.Context.Err() != nil {
		x.failContext(route.Context, fmt.Errorf("%w: %w", errRolloutEnded, context.Cause(route.Context)))
		return
	}

	body, status, err := x.readBody()
	if err != nil {
		code := "invalid_request_body"
		if status == http.StatusRequestEntityTooLarge {
			code = "request_too_large"
		}
		x.fail(status, code, "", err.Error())
		return
	}
	if c.API == APIResponses {
		chat, rc, re := translateResponsesRequest(body)
		if re != nil {
			x.fail(http.StatusBadRequest, re.code, re.param, re.msg)
			return
		}
		body, x.resp = chat, rc
	}
	if re := x.req.parse(body); re != nil {
		x.fail(http.StatusBadRequest, re.code, re.param, re.msg)
		return
	}
	ask := false
	if p.askTokens {
		base := route.BaseURL
		if x.engines != nil {
			// The engines serve one policy: what one refuses, all do.
			base = "engines"
		}
		x.policy = newUpstreamKey(base, x.req.stream)
		x.refused = p.refusals.refused(x.policy)
		ask = x.refused == ""
	}
	out, model, asked := x.req.rewrite(body, route, c.RolloutID, ask)
	x.asked = asked
	c.RequestedModel = x.req.requestedModel
	c.Model = model
	c.RequestMessages = x.req.messageList
	c.Stream = x.req.stream
	x.forward(out)
}

// readBody reads the request body under MaxBodyBytes. Bodies are small
// enough to allocate exactly once, and an owned slice lets the record keep
// the messages without copying them.
func (x *exchange) readBody() ([]byte, int, error) {
	r, limit := x.r, x.p.maxBody
	tooLarge := func() error { return fmt.Errorf("llmproxy: request body exceeds the limit of %d bytes", limit) }
	if r.ContentLength > limit {
		return nil, http.StatusRequestEntityTooLarge, tooLarge()
	}
	rd := http.MaxBytesReader(x.w, r.Body, limit)
	if r.ContentLength >= 0 {
		b := make([]byte, r.ContentLength)
		if _, err := io.ReadFull(rd, b); err != nil {
			return nil, http.StatusBadRequest, fmt.Errorf("llmproxy: reading request body: %w", err)
		}
		return b, 0, nil
	}
	b, err := io.ReadAll(rd)
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
		return nil, http.StatusRequestEntityTooLarge, tooLarge()
	}
	if err != nil {
		return nil, http.StatusBadRequest, fmt.Errorf("llmproxy: reading request body: %w", err)
	}
	return b, 0, nil
}

// forward sends body upstream, retrying per the policy, and answers the client.
func (x *exchange) forward(body []byte) {
	ctx := x.ctx
	if rc := x.route.Context; rc != nil {
		// Cancelling the rollout aborts the in-flight call.
		cctx, cancel := context.WithCancelCause(ctx)
		stop := context.AfterFunc(rc, func() { cancel(fmt.Errorf("%w: %w", errRolloutEnded, context.Cause(rc))) })
		defer func() {
			stop()
			cancel(nil)
		}()
		ctx = cctx
	}
	url := strings.TrimSuffix(x.route.BaseURL, "/") + "/chat/completions"
	header := x.upstreamHeader()
	if x.engines != nil {
		header[HeaderSessionID] = []string{x.session}
	}
	if x.p.tracing != nil {
		ctx = x.startChat(ctx)
		// The policy sees the chat span as its parent.
		x.p.tracing.prop.Inject(ctx, propagation.HeaderCarrier(header))
		defer x.endChat()
	}

	// Each attempt that fails in a way retrying can fix is tried again
	// after the policy's next delay; any other failure, or the end of ctx,
	// stops the call. waited is when the current wait began.
	var (
		last   *upstreamError
		waited time.Time
	)
	endWait := func() {
		if !waited.IsZero() {
			x.backoff += time.Since(waited)
			waited = time.Time{}
		}
	}
	if x.engines != nil {
		x.engines.calls.Add(1)
		defer x.engines.calls.Add(-1)
	}
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		endWait()
		target, e := url, (*engine)(nil)
		if x.engines != nil {
			// A retry after an engine in the ring answered 5xx or timed
			// out, the signs of engines overloaded together, adds load and
			// takes from the budget. One after a broken connection (refused,
			// reset, cut: the engine died or restarted, with the call's work
			// gone with it), or away from an engine that left the ring, only
			// moves the load, and always goes: a dying engine cuts all its
			// calls at once, before it leaves the ring.
			if n := len(x.tried); n > 0 && x.tried[n-1].up.Load() && last != nil && last.kind != "transport" {
				if !x.engines.beginRetry() {
					x.budgetSpent = true
					return struct{}{}, backoff.Permanent(last)
				}
				defer x.engines.endRetry()
			}
			if e = x.pickEngine(); e == nil {
				x.call.Attempts++
				last = &upstreamError{kind: "transport", detail: "llmproxy: no policy engine is known yet (dns:// names not resolved)", retry: true}
				x.p.metrics.attempt(attemptTransport)
				return struct{}{}, last
			}
			target = e.url + "/chat/completions"
		}
		x.call.Attempts++
		last, body = x.send(ctx, e, target, header, body)
		if e != nil {
			x.engineDone(ctx, e, last)
		}
		x.p.metrics.attempt(x.attemptOutcome(ctx, last))
		switch {
		case last == nil:
			return struct{}{}, nil
		case ctx.Err() != nil:
			return struct{}{}, backoff.Permanent(context.Cause(ctx))
		case !last.retry:
			return struct{}{}, backoff.Permanent(last)
		}
		return struct{}{}, last
	},
		backoff.WithBackOff(x.retryBackOff()),
		backoff.WithMaxTries(uint(x.p.retry.MaxRetries)+1),
		backoff.WithMaxElapsedTime(0), // bounded by MaxRetries alone
		backoff.WithNotify(func(_ error, d time.Duration) {
			x.p.log.LogAttrs(ctx, slog.LevelWarn, "llmproxy: retrying upstream call",
				slog.String("rollout_id", x.call.RolloutID), slog.String("sample_id", x.call.SampleID),
				slog.Int("attempt", x.call.Attempts+1), slog.Duration("delay", d), slog.String("error", last.Error()))
			x.retried(x.call.Attempts, d, last)
			waited = time.Now()
		}))
	endWait()
	// Retry hands back a permanent error still wrapped when it came on the
	// last try allowed.
	if pe, ok := errors.AsType[*backoff.PermanentError](err); ok {
		err = pe.Unwrap()
	}
	if x.engines != nil && x.call.Engine != "" {
		x.engines.metrics.routed(x.home == "" || x.call.Engine == x.home)
	}
	if x.refusal != "" && x.call.StatusCode >= 200 && x.call.StatusCode <= 299 {
		// Without the members the upstream answered: it refuses them.
		x.p.refusals.remember(x, x.policy, x.refusal)
	}
	switch {
	case err == nil:
	case last != nil && err == error(last):
		x.failUpstream(last)
	default: // ctx ended, during an attempt or a wait
		x.failContext(ctx, context.Cause(ctx))
	}
}

// send makes one try of the call on the upstream at url (engine e, when
// the call goes over the engines). The try is made again at once, and is
// no retry, when the upstream did nothing wrong: an attempt an abort pause
// cut before the client got anything goes again once the policy resumes,
// and one refused for the token members it asked for goes again without
// them (the answer was about them, not about the upstream's load). It
// returns the try's outcome and the body any later retry sends.
func (x *exchange) send(ctx context.Context, e *engine, url string, header http.Header, body []byte) (*upstreamError, []byte) {
	for {
		last, version, cut := x.gatedAttempt(ctx, e, url, header, body)
		switch {
		case cut:
			x.p.metrics.attempt(attemptPaused)
			a := osmo.UpstreamAttempt{Attempt: x.call.Attempts, Paused: true, PolicyVersion: version, Error: last.Error()}
			if e != nil {
				a.Engine = e.url
			}
			x.call.UpstreamAttempts = append(x.call.UpstreamAttempts, a)
		case last != nil && last.kind == kindTokensRefused:
			x.p.metrics.attempt(attemptTokensRefused)
			x.retried(x.call.Attempts, 0, last)
			x.refusal = tokensRefused(x.asked, last)
			body = x.req.withoutTokens(x.asked)
			x.asked = nil
			x.logAttempt(e, last)
		default:
			return last, body
		}
		x.call.Attempts++
	}
}

// gatedAttempt makes one upstream attempt on engine e (nil off the
// engines) through the pause gate, waiting while the policy is paused.
// cut reports that an abort pause cut it before the client got anything;
// version is the policy version it ran under, the call's when it was not
// cut. The watch on e leaving the ring starts once the gate lets the
// attempt through: an engine that leaves while the call is held (say,
// restarted for new weights) fails the attempt at once, as a retry to
// another engine, instead of ending a call that never reached it.
func (x *exchange) gatedAttempt(ctx context.Context, e *engine, url string, header http.Header, body []byte) (last *upstreamError, version int64, cut bool) {
	g := x.p.gate
	if g == nil {
		actx, stop := x.untilEngineLeaves(ctx, e)
		defer stop()
		return x.attempt(actx, url, header, body), 0, false
	}
	t, gctx, held, err := g.enter(ctx)
	x.held += held
	if err != nil {
		// ctx ended while held: the caller reads ctx's cause.
		return &upstreamError{kind: "transport", detail: "llmproxy: call ended while the policy was paused: " + err.Error()}, 0, false
	}
	actx, stop := x.untilEngineLeaves(gctx, e)
	last = x.attempt(actx, url, header, body)
	stop()
	version = g.leave(t)
	if last != nil && ctx.Err() == nil && errors.Is(context.Cause(gctx), errPauseAbort) {
		return last, t.version, true
	}
	x.call.PolicyVersion = version
	x.versioned = true
	return last, version, false
}

// upstreamHeader builds the headers every attempt sends.
func (x *exchange) upstreamHeader() http.Header {
	in, c, route := x.r.Header, x.call, x.route
	h := make(http.Header, 8)
	h["Content-Type"] = []string{"application/json"}
	h[HeaderRolloutID] = []string{c.RolloutID}
	if c.SampleID != "" {
		h[HeaderSampleID] = []string{c.SampleID}
	}
	switch {
	case route.APIKey != "":
		h["Authorization"] = []string{"Bearer " + route.APIKey}
	case route.ClientToken == "":
		// With a ClientToken the client's header holds the proxy's secret,
		// which must not leak upstream.
		if v := in["Authorization"]; len(v) > 0 {
			h["Authorization"] = v
		}
	}
	for _, k := range [...]string{"Traceparent", "Tracestate", "Baggage", "Accept", "X-Request-Id"} {
		if v := in[k]; len(v) > 0 {
			h[k] = v
		}
	}
	return h
}

// attemptOutcome labels an attempt for osmo_llmproxy_upstream_attempts_total.
func (x *exchange) attemptOutcome(ctx context.Context, last *upstreamError) string {
	switch {
	case last == nil && x.call.StatusCode >= 200 && x.call.StatusCode <= 299:
		return attemptOK
	case last == nil:
		return attemptRejected
	case ctx.Err() != nil:
		return attemptAborted
	}
	switch last.kind {
	case "status":
		return attemptHTTP5xx
	case "timeout":
		return attemptTimeout
	case "transport":
		return attemptTransport
	case "malformed":
		return attemptMalformed
	case "too_large":
		return attemptTooLarge
	default:
		return attemptBadRoute
	}
}

// kindTokensRefused is the upstreamError.kind of an attempt that asked for
// token ids and got a 4xx a request validator answers; it never ends a call.
const kindTokensRefused = "tokens_refused"

// upstreamError is a failed attempt.
type upstreamError struct {
	kind   string // "timeout", "transport", "status", "malformed", "too_large", "config", kindTokensRefused
	status int
	detail string
	retry  bool
	// refused is set when the upstream refused the connection: nothing
	// listens there.
	refused bool
}

// errType is the error.type of a call that failed this way: the status
// code for an HTTP error, else the kind of failure.
func (e *upstreamError) errType() string {
	switch e.kind {
	case "status":
		return strconv.Itoa(e.status)
	case "config":
		return "invalid_route"
	}
	return e.kind
}

func (e *upstreamError) Error() string {
	switch e.kind {
	case "timeout":
		return "upstream did not answer within the per-attempt timeout of " + e.detail
	case "status":
		return fmt.Sprintf("upstream answered %d: %s", e.status, e.detail)
	case "malformed":
		return fmt.Sprintf("upstream answered %d with a malformed body: %s", e.status, e.detail)
	default:
		return e.detail
	}
}

// attempt makes one upstream call. It returns nil once it has answered the
// client (the call may still have failed, as recorded in x.call).
func (x *exchange) attempt(ctx context.Context, url string, header http.Header, body []byte) *upstreamError {
	actx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	timer := time.AfterFunc(x.timeout(), func() { cancel(errAttemptTimeout) })
	defer timer.Stop()

	req, err := http.NewRequestWithContext(actx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return &upstreamError{kind: "config", detail: fmt.Sprintf("llmproxy: route of rollout %q has an unusable base URL %q: %v", x.call.RolloutID, x.route.BaseURL, err)}
	}
	req.Header = header
	t0 := time.Now()
	resp, err := x.p.transport.RoundTrip(req)
	if err != nil {
		x.upstream += time.Since(t0)
		return x.readFailure(actx, err)
	}
	if x.answering != nil {
		x.answering()
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode >= 500:
		snippet := drainSnippet(resp.Body)
		x.upstream += time.Since(t0)
		return &upstreamError{kind: "status", status: resp.StatusCode, detail: snippet, retry: true}
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		if len(x.asked) > 0 && refusesTokens(resp.StatusCode) {
			// Perhaps the token members; the caller asks again without.
			snippet := drainSnippet(resp.Body)
			x.upstream += time.Since(t0)
			return &upstreamError{kind: kindTokensRefused, status: resp.StatusCode, detail: snippet}
		}
		return x.passThrough(actx, resp, t0)
	case isEventStream(resp.Header.Get("Content-Type")):
		return x.relayStream(actx, resp, t0, timer)
	default:
		return x.relayJSON(actx, resp, t0)
	}
}

// readFailure classifies an error from the transport or the response body.
func (x *exchange) readFailure(actx context.Context, err error) *upstreamError {
	if errors.Is(context.Cause(actx), errAttemptTimeout) {
		return &upstreamError{kind: "timeout", detail: x.timeout().String(), retry: true}
	}
	if errors.Is(context.Cause(actx), errEngineLeft) {
		return &upstreamError{kind: "transport", detail: errEngineLeft.Error(), retry: true}
	}
	pe, ok := errors.AsType[permanentError](err)
	permanent := ok && pe.Permanent()
	return &upstreamError{kind: "transport", detail: "upstream transport error: " + err.Error(), retry: !permanent, refused: errors.Is(err, syscall.ECONNREFUSED)}
}

// permanentError is a transport error that retrying cannot fix (see
// Config.Transport).
type permanentError interface {
	error
	Permanent() bool
}

// readBounded reads a whole upstream body.
func (x *exchange) readBounded(actx context.Context, resp *http.Response) (*bytes.Buffer, *upstreamError) {
	tooLarge := func() *upstreamError {
		return &upstreamError{kind: "too_large", detail: fmt.Sprintf("upstream response exceeds the limit of %d bytes", x.p.maxResp)}
	}
	if resp.ContentLength > x.p.maxResp {
		return nil, tooLarge()
	}
	buf := new(bytes.Buffer)
	if resp.ContentLength > 0 {
		// Room for the trailing EOF read too, so the buffer never regrows.
		buf.Grow(int(resp.ContentLength) + bytes.MinRead)
	}
	_, err := buf.ReadFrom(io.LimitReader(resp.Body, x.p.maxResp+1))
	switch {
	case err != nil:
		return nil, x.readFailure(actx, err)
	case int64(buf.Len()) > x.p.maxResp:
		return nil, tooLarge()
	}
	return buf, nil
}

// passThrough hands a non-2xx, non-5xx answer (a 4xx above all) to the
// client unchanged: G1 clients fail at once on those, and the client should
// see the upstream's own explanation.
func (x *exchange) passThrough(actx context.Context, resp *http.Response, t0 time.Time) *upstreamError {
	buf, uerr := x.readBounded(actx, resp)
	x.upstream += time.Since(t0)
	if uerr != nil {
		uerr.retry = false
		return uerr
	}
	data := buf.Bytes()
	x.call.Error = fmt.Sprintf("upstream answered %d: %s", resp.StatusCode, snippet(data))
	x.errType = strconv.Itoa(resp.StatusCode)
	x.writeUpstream(resp, data)
	return nil
}

// relayJSON forwards a non-stream completion and records it.
func (x *exchange) relayJSON(actx context.Context, resp *http.Response, t0 time.Time) *upstreamError {
	buf, uerr := x.readBounded(actx, resp)
	x.upstream += time.Since(t0)
	if uerr != nil {
		return uerr
	}
	data := buf.Bytes()
	if err := recordCompletion(x.call, data); err != nil {
		return &upstreamError{kind: "malformed", status: resp.StatusCode, detail: err.Error() + "; body starts: " + snippet(data), retry: true}
	}
	if x.resp != nil {
		data = x.resp.complete(x.call)
	}
	x.writeUpstream(resp, data)
	return nil
}

// writeUpstream answers the client with an upstream status and body.
func (x *exchange) writeUpstream(resp *http.Response, data []byte) {
	h := x.w.Header()
	ct := resp.Header.Get("Content-Type")
	if ct == "" {
		ct = "application/json"
	}
	h.Set("Content-Type", ct)
	copyHeaders(h, resp.Header)
	h.Set("Content-Length", strconv.Itoa(len(data)))
	x.setServerTiming(h)
	x.w.WriteHeader(resp.StatusCode)
	x.call.StatusCode = resp.StatusCode
	if _, err := x.w.Write(data); err != nil && x.call.Error == "" {
		x.call.Error = "llmproxy: writing the response to the client: " + err.Error()
	}
}

// copyHeaders passes on the upstream headers a client may act on.
func copyHeaders(dst, src http.Header) {
	for _, k := range [...]string{"Retry-After", "X-Request-Id"} {
		if v := src[k]; len(v) > 0 {
			dst[k] = v
		}
	}
}

// failUpstream answers after the last attempt failed.
func (x *exchange) failUpstream(e *upstreamError) {
	status, code := http.StatusBadGateway, "upstream_error"
	switch e.kind {
	case "timeout":
		status, code = http.StatusGatewayTimeout, "upstream_timeout"
	case "malformed":
		code = "upstream_malformed_response"
	case "transport":
		code = "upstream_unreachable"
	case "too_large":
		code = "upstream_response_too_large"
	case "config":
		status, code = http.StatusInternalServerError, "invalid_route"
	}
	x.errType = e.errType()
	msg := e.Error()
	if e.kind != "config" {
		msg = fmt.Sprintf("llmproxy: upstream call failed after %d attempt(s): %s", x.call.Attempts, msg)
	}
	if x.budgetSpent {
		msg += "; not retried: the engines' retry budget is spent (too many retries in flight)"
	}
	x.failTyped(status, "upstream_error", code, "", msg)
}

// failContext answers when ctx ended: the rollout ended (503, or 504 when
// its deadline passed) or the client went away (nothing to answer; 499 is
// recorded, as nginx logs it).
func (x *exchange) failContext(ctx context.Context, cause error) {
	if cause == nil {
		cause = ctx.Err()
	}
	if errors.Is(cause, errRolloutEnded) {
		status := http.StatusServiceUnavailable
		if errors.Is(cause, context.DeadlineExceeded) {
			status = http.StatusGatewayTimeout
		}
		x.errType = "rollout_ended"
		x.failTyped(status, "upstream_error", "rollout_ended", "", "llmproxy: upstream call aborted: "+cause.Error())
		return
	}
	x.call.StatusCode = 499
	x.call.Error = "llmproxy: client closed the request: " + cause.Error()
	x.errType = "client_closed"
}

// fail answers a client mistake.
func (x *exchange) fail(status int, code, param, msg string) {
	x.failTyped(status, "invalid_request_error", code, param, msg)
}

func (x *exchange) failTyped(status int, typ, code, param, msg string) {
	x.call.StatusCode = status
	x.call.Error = msg
	x.p.writeError(x.w, serverTiming(time.Since(x.start), x.upstream, x.backoff), status, typ, code, param, msg)
}

// finish logs and records the call.
func (x *exchange) finish() {
	c := x.call
	latency := time.Since(x.start)
	c.LatencyMS = float64(latency) / float64(time.Millisecond)
	c.HeldMS = float64(x.held) / float64(time.Millisecond)
	if x.versioned {
		x.p.gate.counted(c.PolicyVersion)
	} else if x.p.gate != nil {
		c.PolicyVersion = x.p.gate.Version()
	}
	x.p.metrics.request(c.StatusCode)
	x.p.metrics.addedLatency(latency - x.upstream - x.backoff - x.held)
	ctx := x.ctx
	if c.Error != "" {
		x.p.log.LogAttrs(ctx, slog.LevelWarn, "llmproxy: call failed",
			slog.String("rollout_id", c.RolloutID), slog.String("sample_id", c.SampleID),
			slog.String("model", c.Model), slog.Int("status", c.StatusCode), slog.Int("attempts", c.Attempts),
			slog.Duration("latency", latency), slog.String("error", c.Error))
	} else if x.p.log.Enabled(ctx, slog.LevelDebug) {
		x.p.log.LogAttrs(ctx, slog.LevelDebug, "llmproxy: call",
			slog.String("rollout_id", c.RolloutID), slog.String("sample_id", c.SampleID),
			slog.String("model", c.Model), slog.Int("status", c.StatusCode), slog.Int("attempts", c.Attempts),
			slog.Bool("stream", c.Stream), slog.Duration("latency", latency),
			slog.Int("prompt_tokens", c.Usage.PromptTokens), slog.Int("completion_tokens", c.Usage.CompletionTokens))
	}
	x.noteMissingTokens()
	if x.p.recorder != nil {
		// The client may be gone; the record must still be kept.
		x.p.recorder.RecordCall(context.WithoutCancel(ctx), c)
	}
}

// setServerTiming tells the client how much of the wait was the proxy's.
func (x *exchange) setServerTiming(h http.Header) {
	h["Server-Timing"] = []string{serverTiming(time.Since(x.start), x.upstream, x.backoff)}
}

func serverTiming(total, upstream, backoff time.Duration) string {
	own := total - upstream - backoff
	if own < 0 {
		own = 0
	}
	b := make([]byte, 0, 64)
	b = appendMillis(append(b, "proxy;dur="...), own)
	b = appendMillis(append(b, ", upstream;dur="...), upstream)
	if backoff > 0 {
		b = appendMillis(append(b, ", backoff;dur="...), backoff)
	}
	return string(b)
}

func appendMillis(b []byte, d time.Duration) []byte {
	return strconv.AppendFloat(b, float64(d)/float64(time.Millisecond), 'f', 3, 64)
}

// writeError answers with an OpenAI-shaped error.
func (p *Proxy) writeError(w http.ResponseWriter, timing string, status int, typ, code, param, msg string) {
	type apiError struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	}
	e := apiError{Message: msg, Type: typ, Code: code}
	if param != "" {
		e.Param = &param
	}
	body, err := json.Marshal(struct {
		Error apiError `json:"error"`
	}{e})
	if err != nil {
		body = []byte(`{"error":{"message":"llmproxy: internal error","type":"server_error","param":null,"code":null}}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h["Server-Timing"] = []string{timing}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// bearerMatches checks an Authorization header against token in constant
// time. A bare token without the "Bearer" scheme is accepted too, as the
// G1 server did.
func bearerMatches(header, token string) bool {
	got := header
	if len(got) > 7 && strings.EqualFold(got[:7], "bearer ") {
		got = strings.TrimSpace(got[7:])
	}
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(token)) == 1
}

// validHeaderValue reports whether s can be sent as an HTTP header value.
func validHeaderValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

func isEventStream(ct string) bool {
	return strings.HasPrefix(strings.TrimSpace(strings.ToLower(ct)), "text/event-stream")
}

// drainSnippet reads a failed response (a bounded amount, so the connection
// can be reused) and returns its start for error messages.
func drainSnippet(body io.Reader) string {
	b, _ := io.ReadAll(io.LimitReader(body, 64<<10))
	return snippet(b)
}

// snippet is the start of a body, fit for an error message.
func snippet(b []byte) string {
	const max = 512
	b = bytes.TrimSpace(b)
	cut := len(b) > max
	if cut {
		b = b[:max]
	}
	s := strings.ToValidUTF8(string(b), "\uFFFD")
	if cut {
		s += "…"
	}
	if s == "" {
		s = "(empty body)"
	}
	return s
}
