package controller

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/osmo-rl/osmo/internal/server"
)

// maxBody bounds what a controller reads of any request or answer body.
const maxBody = 64 << 20

// shutdownGrace is how long a controller, once its context ends, waits for
// the calls in progress (a callback being committed, a chat being answered)
// before cutting them.
const shutdownGrace = 5 * time.Second

// Callback kinds: the completion callback says the agent finished, the
// grader callback carries the graded result.
const (
	kindCompletion = "completion"
	kindGrader     = "grader"
)

// faults is how a controller fails callback posts on purpose, to exercise
// a rollout server's retries: the first few, a random share, or all of
// them while it is set down.
type faults struct {
	first      int
	firstField string // the option first came from, for errors
	fraction   float64
	status     int
}

// endpoint is what the controllers of every wire share: the listener, the
// client, and the log of LLM calls and callbacks that tests read and wait
// on. T is the wire's callback type.
type endpoint[T any] struct {
	// chatURL is where LLM calls go on to: the policy's chat completions.
	chatURL *url.URL
	ln      net.Listener
	srv     *http.Server
	mux     *http.ServeMux
	client  *http.Client
	logger  *slog.Logger
	faults  faults
	// unauthorized is the detail of a 401, in the wire's words.
	unauthorized string

	// inFlight counts LLM calls being relayed to the policy right now.
	inFlight atomic.Int64

	mu        sync.Mutex
	callbacks map[callbackKey][]T
	chats     []ChatCall
	rejected  []string
	failed    int
	down      bool
	changed   chan struct{} // closed and replaced on every recorded callback
}

type callbackKey struct{ kind, rolloutID string }

// newEndpoint checks the settings and opens the listener on addr; name (the
// constructor) prefixes its errors. A zero timeout leaves the client
// unbounded, for wires whose callers' contexts bound each call.
func newEndpoint[T any](name, addr, policyURL string, f faults, logger *slog.Logger, timeout time.Duration) (*endpoint[T], error) {
	if policyURL == "" {
		return nil, fmt.Errorf("%s: PolicyURL is required", name)
	}
	chatURL, err := url.Parse(strings.TrimRight(policyURL, "/") + "/chat/completions")
	if err != nil {
		return nil, fmt.Errorf("%s: PolicyURL: %w", name, err)
	}
	if f.status == 0 {
		f.status = http.StatusServiceUnavailable
	}
	switch {
	case f.first < 0:
		return nil, fmt.Errorf("%s: %s must not be negative, got %d", name, f.firstField, f.first)
	case f.fraction < 0 || f.fraction > 1:
		return nil, fmt.Errorf("%s: FailFraction must be in [0, 1], got %v", name, f.fraction)
	case f.status < 400 || f.status > 599:
		return nil, fmt.Errorf("%s: FailStatus must be an HTTP error status (400-599), got %d", name, f.status)
	}
	if logger == nil {
		logger = slog.Default()
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	e := &endpoint[T]{
		chatURL:      chatURL,
		ln:           ln,
		mux:          http.NewServeMux(),
		client:       newClient(timeout),
		logger:       logger,
		faults:       f,
		unauthorized: server.AuthMessage,
		callbacks:    map[callbackKey][]T{},
		changed:      make(chan struct{}),
	}
	e.srv = &http.Server{Handler: e.mux, ReadHeaderTimeout: 10 * time.Second}
	return e, nil
}

// URL is the controller's base URL (http://host:port).
func (e *endpoint[T]) URL() string { return "http://" + e.ln.Addr().String() }

// Serve runs until ctx ends, then shuts down, returning once the calls in
// progress have finished (or shutdownGrace is past): what they record is
// complete when it returns.
func (e *endpoint[T]) Serve(ctx context.Context) error {
	// Its own idle connections go with it.
	defer e.client.CloseIdleConnections()
	if err := server.ServeHTTP(ctx, e.srv, e.ln, shutdownGrace); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	return nil
}

// post sends v as JSON to base+path, bearing bearer when it is not empty.
func (e *endpoint[T]) post(ctx context.Context, base, path, bearer string, header http.Header, v any) (int, http.Header, []byte, error) {
	payload, err := json.Marshal(v)
	if err != nil {
		return 0, nil, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+path, bytes.NewReader(payload))
	if err != nil {
		return 0, nil, nil, err
	}
	for k, v := range header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	return resp.StatusCode, resp.Header, data, err
}

// authorized reports whether r carries key as its bearer; an empty key
// lets everything through.
func authorized(r *http.Request, key string) bool {
	if key == "" {
		return true
	}
	scheme, token, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	return strings.EqualFold(scheme, "bearer") && subtle.ConstantTimeCompare([]byte(token), []byte(key)) == 1
}

func writeDetail(w http.ResponseWriter, status int, detail string) {
	b, _ := json.Marshal(map[string]string{"detail": detail})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// ack answers a callback with the wire's acknowledgement body.
func ack(w http.ResponseWriter, body string) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(body))
}

// readBody reads a request's body after checking its bearer; it answers
// the refusals itself.
func (e *endpoint[T]) readBody(w http.ResponseWriter, r *http.Request, key string) ([]byte, bool) {
	if !authorized(r, key) {
		writeDetail(w, http.StatusUnauthorized, e.unauthorized)
		return nil, false
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		writeDetail(w, http.StatusBadRequest, "reading body: "+err.Error())
		return nil, false
	}
	return body, true
}

// readCall reads an LLM call's body, which must be a JSON object.
func (e *endpoint[T]) readCall(w http.ResponseWriter, r *http.Request, key string) ([]byte, map[string]any, bool) {
	body, ok := e.readBody(w, r, key)
	if !ok {
		return nil, nil, false
	}
	var parsed map[string]any
	if err := json.Unmarshal(body, &parsed); err != nil || parsed == nil {
		writeDetail(w, http.StatusBadRequest, "body must be a JSON object")
		return nil, nil, false
	}
	return body, parsed, true
}

// chat serves LLM calls: it checks and records each, then relays it to
// the policy. rolloutID names a call's rollout, or says why the call is
// refused (400).
func (e *endpoint[T]) chat(key string, rolloutID func(r *http.Request, body map[string]any) (id, refused string)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, parsed, ok := e.readCall(w, r, key)
		if !ok {
			return
		}
		id, refused := rolloutID(r, parsed)
		if refused != "" {
			writeDetail(w, http.StatusBadRequest, refused)
			return
		}
		e.recordChat(ChatCall{Header: r.Header.Clone(), Body: parsed})
		e.relay(w, r, id, "", body, nil)
	}
}

func (e *endpoint[T]) recordChat(call ChatCall) {
	e.mu.Lock()
	e.chats = append(e.chats, call)
	e.mu.Unlock()
}

// forwardHeaders go from an LLM call on to the policy: the ids and trace
// context its logs and spans join on, and the mock policy's failure switch.
var forwardHeaders = [...]string{"X-Rollout-Id", "X-Sample-Id", "Traceparent", "Baggage", "X-Mock-Fail"}

// relay sends an LLM call's body on to the policy (bearing key when not
// empty, never the caller's bearer) and streams the answer back:
// FlushInterval -1 flushes every write, so each SSE event reaches the
// caller when the policy sends it. When whole is set, a successful answer
// that is not a stream is also handed to it whole.
func (e *endpoint[T]) relay(w http.ResponseWriter, r *http.Request, rolloutID, key string, body []byte, whole func(answer []byte)) {
	e.inFlight.Add(1)
	defer e.inFlight.Add(-1)
	log := e.logger.With("rollout_id", rolloutID)
	proxy := &httputil.ReverseProxy{
		Transport:     e.client.Transport,
		FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			u := *e.chatURL
			pr.Out.URL, pr.Out.Host = &u, ""
			pr.Out.Header = http.Header{"Content-Type": {"application/json"}}
			for _, h := range forwardHeaders {
				if v := pr.In.Header.Get(h); v != "" {
					pr.Out.Header.Set(h, v)
				}
			}
			if key != "" {
				pr.Out.Header.Set("Authorization", "Bearer "+key)
			}
			pr.Out.Body, pr.Out.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		},
		ModifyResponse: func(resp *http.Response) error {
			if whole == nil || resp.StatusCode != http.StatusOK || strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				return nil
			}
			answer, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
			resp.Body.Close()
			if err != nil {
				return err
			}
			whole(answer)
			resp.Body = io.NopCloser(bytes.NewReader(answer))
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			log.WarnContext(r.Context(), "controller: policy call failed", "error", err)
			writeDetail(w, http.StatusBadGateway, "policy: "+err.Error())
		},
	}
	proxy.ServeHTTP(w, r)
}

// receive reads a callback through parse, which returns the callback, the
// rollout id it names (for logs, even when refusing) and why it is
// refused: a refusal answers 422 and is kept for Rejected, so that a test
// waiting in vain can say why.
func (e *endpoint[T]) receive(w http.ResponseWriter, r *http.Request, kind, key string, parse func(body []byte) (T, string, error)) (T, bool) {
	var zero T
	body, ok := e.readBody(w, r, key)
	if !ok {
		return zero, false
	}
	cb, id, err := parse(body)
	if err != nil {
		e.logger.WarnContext(r.Context(), "controller: callback refused", "kind", kind, "rollout_id", id, "error", err)
		e.mu.Lock()
		e.rejected = append(e.rejected, fmt.Sprintf("%s callback for %q: %v", kind, id, err))
		e.mu.Unlock()
		writeDetail(w, http.StatusUnprocessableEntity, err.Error())
		return zero, false
	}
	return cb, true
}

// injectFailure answers a well-formed callback with FailStatus when the
// faults say so, and reports whether it did.
func (e *endpoint[T]) injectFailure(w http.ResponseWriter) bool {
	e.mu.Lock()
	fail := e.down || e.failed < e.faults.first || (e.faults.fraction > 0 && rand.Float64() < e.faults.fraction)
	if fail {
		e.failed++
	}
	e.mu.Unlock()
	if fail {
		writeDetail(w, e.faults.status, "injected failure")
	}
	return fail
}

// record keeps cb as a kind callback of rolloutID and wakes the waiters.
func (e *endpoint[T]) record(kind, rolloutID string, cb T) {
	k := callbackKey{kind, rolloutID}
	e.mu.Lock()
	e.callbacks[k] = append(e.callbacks[k], cb)
	close(e.changed)
	e.changed = make(chan struct{})
	e.mu.Unlock()
}

// unrecord drops the last kind callback of rolloutID: one the controller
// answered with an error after all, so the server will send it again.
func (e *endpoint[T]) unrecord(kind, rolloutID string) {
	k := callbackKey{kind, rolloutID}
	e.mu.Lock()
	defer e.mu.Unlock()
	if n := len(e.callbacks[k]); n > 0 {
		e.callbacks[k] = e.callbacks[k][:n-1]
	}
}

// wait blocks until a kind callback for rolloutID arrived or ctx ends, and
// returns the first one.
func (e *endpoint[T]) wait(ctx context.Context, kind, rolloutID string) (T, error) {
	for {
		e.mu.Lock()
		got := e.callbacks[callbackKey{kind, rolloutID}]
		changed := e.changed
		rejected := e.rejected
		e.mu.Unlock()
		if len(got) > 0 {
			return got[0], nil
		}
		select {
		case <-ctx.Done():
			err := fmt.Errorf("controller: waiting for the %s callback of %q: %w", kind, rolloutID, ctx.Err())
			if len(rejected) > 0 {
				// A refused callback is the likely reason nothing arrived.
				err = fmt.Errorf("%w (refused so far: %s)", err, strings.Join(rejected, "; "))
			}
			var zero T
			return zero, err
		case <-changed:
		}
	}
}

func (e *endpoint[T]) received(kind, rolloutID string) []T {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]T(nil), e.callbacks[callbackKey{kind, rolloutID}]...)
}

// Completions returns every completion callback received for rolloutID
// (duplicates included: a correct server posts exactly one).
func (e *endpoint[T]) Completions(rolloutID string) []T {
	return e.received(kindCompletion, rolloutID)
}

// Chats returns the LLM calls accepted so far (those refused for a bad
// bearer or a malformed body are not among them).
func (e *endpoint[T]) Chats() []ChatCall {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]ChatCall(nil), e.chats...)
}

// InFlight is how many LLM calls the controller is relaying now: a call
// whose client went away (a cancelled rollout) ends and leaves this count.
func (e *endpoint[T]) InFlight() int { return int(e.inFlight.Load()) }

// SetDown makes every well-formed callback post answer FailStatus (down)
// or lifts it: a trainer that is down for a while.
func (e *endpoint[T]) SetDown(down bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.down = down
}

// FailedCallbacks is how many callback posts were answered with an
// injected failure.
func (e *endpoint[T]) FailedCallbacks() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.failed
}

// Rejected describes the callbacks refused as malformed (answered 422).
func (e *endpoint[T]) Rejected() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.rejected...)
}

// keepAliveConns is how many idle connections a controller keeps to each
// host, as a trainer's pooled client does: Go's default of two would open
// and close a connection for nearly every request under load.
const keepAliveConns = 1024

// newClient is a controller's HTTP client; timeout 0 is none.
func newClient(timeout time.Duration) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = keepAliveConns, keepAliveConns
	return &http.Client{Transport: tr, Timeout: timeout}
}
