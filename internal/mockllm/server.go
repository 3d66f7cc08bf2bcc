// Package mockllm is a deterministic OpenAI-compatible policy double. It
// stands in for a vLLM-served policy or a hosted provider in demos, tests and
// benchmarks: it answers /v1/chat/completions (JSON and SSE), solves
// arithmetic tasks by calling the tools it is offered one turn at a time (as
// tool_choice allows), reports usage, vLLM token ids and logprobs, and fails
// on demand the way real servers fail (5xx, 429 with Retry-After, hangs,
// malformed bodies).
//
// The same request always gets the same response, ids included, so tests
// can compare bytes.
package mockllm

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// Failure modes accepted by Options.FailMode and the X-Mock-Fail header.
const (
	Fail500       = "500"
	Fail503       = "503"
	Fail429       = "429"
	Fail400       = "400"
	FailHang      = "hang"
	FailMalformed = "malformed"
)

// FailHeader is the request header that makes one request fail on purpose.
const FailHeader = "X-Mock-Fail"

// DefaultModel is the model id listed by /v1/models when Options.Model is empty.
const DefaultModel = "mock-policy"

// DefaultMaxRequestBytes bounds a request body when Options.MaxRequestBytes is 0.
const DefaultMaxRequestBytes = 16 << 20

// Options configure a Server. The zero value serves every request correctly
// and at once.
type Options struct {
	// Model is listed by /v1/models and answered when a request names none.
	Model string
	// Latency is waited before the response headers of each chat completion.
	Latency time.Duration
	// ChunkDelay is waited between SSE chunks.
	ChunkDelay time.Duration
	// FailMode is how injected failures fail: "500", "503", "429", "400"
	// (the prompt is over the context length, as OpenAI answers it), "hang"
	// or "malformed". It needs FailEvery or FailFirst to say which requests.
	FailMode string
	// FailEvery makes every Nth chat request fail (0: never).
	FailEvery int
	// FailFirst makes the first N chat requests fail, then all succeed.
	FailFirst int
	// MaxRequestBytes bounds request bodies (0: DefaultMaxRequestBytes);
	// larger ones get 413.
	MaxRequestBytes int64
	// Logger receives one record per chat request (nil: discard).
	Logger *slog.Logger
}

// Server is the mock policy; it is an http.Handler safe for concurrent use.
type Server struct {
	opts     Options
	requests atomic.Int64
}

var _ http.Handler = (*Server)(nil)

// New validates opts and returns a Server.
func New(opts Options) (*Server, error) {
	opts.Model = cmp.Or(opts.Model, DefaultModel)
	opts.MaxRequestBytes = cmp.Or(opts.MaxRequestBytes, DefaultMaxRequestBytes)
	switch {
	case !validFailMode(opts.FailMode):
		return nil, fmt.Errorf("mockllm: unknown FailMode %q (want 500, 503, 429, 400, hang or malformed)", opts.FailMode)
	case opts.Latency < 0:
		return nil, fmt.Errorf("mockllm: Latency must not be negative, got %v", opts.Latency)
	case opts.ChunkDelay < 0:
		return nil, fmt.Errorf("mockllm: ChunkDelay must not be negative, got %v", opts.ChunkDelay)
	case opts.FailEvery < 0:
		return nil, fmt.Errorf("mockllm: FailEvery must not be negative, got %d", opts.FailEvery)
	case opts.FailFirst < 0:
		return nil, fmt.Errorf("mockllm: FailFirst must not be negative, got %d", opts.FailFirst)
	case opts.MaxRequestBytes < 0:
		return nil, fmt.Errorf("mockllm: MaxRequestBytes must not be negative, got %d", opts.MaxRequestBytes)
	case opts.FailMode != "" && opts.FailEvery == 0 && opts.FailFirst == 0:
		// Silently never failing would make a misconfigured test pass.
		return nil, fmt.Errorf("mockllm: FailMode %q needs FailEvery or FailFirst to select requests", opts.FailMode)
	case opts.FailMode == "" && (opts.FailEvery != 0 || opts.FailFirst != 0):
		return nil, errors.New("mockllm: FailEvery and FailFirst need a FailMode")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Server{opts: opts}, nil
}

func validFailMode(m string) bool {
	return slices.Contains([]string{"", Fail500, Fail503, Fail429, Fail400, FailHang, FailMalformed}, m)
}

// Requests reports how many chat completion requests the server has received,
// failed ones included.
func (s *Server) Requests() int64 { return s.requests.Load() }

// ServeHTTP routes /health, /v1/models and chat completions under any prefix.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Path
	switch {
	case p == "/health":
		s.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, map[string]string{"status": "ok"}) })
	case p == "/models" || strings.HasSuffix(p, "/v1/models"):
		s.only(w, r, http.MethodGet, func() {
			writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{
				map[string]any{"id": s.opts.Model, "object": "model", "created": fixedEpoch, "owned_by": "osmo"},
			}})
		})
	case p == "/chat/completions" || strings.HasSuffix(p, "/v1/chat/completions"):
		s.only(w, r, http.MethodPost, func() { s.serveChat(w, r) })
	default:
		writeError(w, http.StatusNotFound, "invalid_request_error", "", "unknown_url",
			fmt.Sprintf("Unknown request URL: %s %s", r.Method, p))
	}
}

func (s *Server) only(w http.ResponseWriter, r *http.Request, method string, serve func()) {
	if r.Method != method {
		w.Header().Set("Allow", method)
		writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "", "method_not_allowed",
			fmt.Sprintf("%s %s: method not allowed, use %s", r.Method, r.URL.Path, method))
		return
	}
	serve()
}

func (s *Server) serveChat(w http.ResponseWriter, r *http.Request) {
	n := s.requests.Add(1)
	ctx := r.Context()
	log := s.opts.Logger.With("request", n)
	if id := r.Header.Get("X-Rollout-Id"); id != "" {
		log = log.With("rollout_id", id)
	}
	if id := r.Header.Get("X-Sample-Id"); id != "" {
		log = log.With("sample_id", id)
	}

	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxRequestBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "", "request_too_large",
				fmt.Sprintf("request body exceeds %d bytes", tooBig.Limit))
			return
		}
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "", "reading request body: "+err.Error())
		return
	}
	mode := r.Header.Get(FailHeader)
	if mode == "" && s.failsByCount(n) {
		mode = s.opts.FailMode
	}
	if !validFailMode(mode) {
		writeError(w, http.StatusBadRequest, "invalid_request_error", FailHeader, "invalid_value",
			fmt.Sprintf("%s: unknown failure mode %q (want 500, 503, 429, 400, hang or malformed)", FailHeader, mode))
		return
	}
	if !sleep(ctx, s.opts.Latency) {
		return
	}
	if mode != "" {
		log.InfoContext(ctx, "mockllm: injected failure", "mode", mode)
		s.fail(ctx, w, mode, body)
		return
	}

	req, apiErr := parseRequest(body)
	if apiErr != nil {
		log.DebugContext(ctx, "mockllm: bad request", "param", apiErr.Param, "error", apiErr.Message)
		apiErr.write(w)
		return
	}
	req.Model = cmp.Or(req.Model, s.opts.Model)
	if id := req.rolloutID(); id != "" && r.Header.Get("X-Rollout-Id") == "" {
		log = log.With("rollout_id", id)
	}
	res := respond(req)
	log.DebugContext(ctx, "mockllm: chat completion", "stream", req.Stream, "finish_reason", res.finish,
		"prompt_tokens", len(res.promptIDs), "completion_tokens", len(res.pieces))
	if !req.Stream {
		writeJSON(w, http.StatusOK, res.completion())
		return
	}
	if err := s.stream(ctx, w, res.chunks(req.includeUsage())); err != nil {
		log.DebugContext(ctx, "mockllm: stream ended early", "error", err)
	}
}

func (s *Server) failsByCount(n int64) bool {
	return s.opts.FailMode != "" && (n <= int64(s.opts.FailFirst) || s.opts.FailEvery > 0 && n%int64(s.opts.FailEvery) == 0)
}

// fail answers the way an unhealthy server does.
func (s *Server) fail(ctx context.Context, w http.ResponseWriter, mode string, body []byte) {
	switch mode {
	case Fail500:
		writeError(w, http.StatusInternalServerError, "server_error", "", "internal_error", "The server had an error while processing your request.")
	case Fail503:
		writeError(w, http.StatusServiceUnavailable, "server_error", "", "service_unavailable", "The server is overloaded or not ready yet.")
	case Fail429:
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusTooManyRequests, "requests", "", "rate_limit_exceeded", "Rate limit reached for requests. Please try again in 1s.")
	case Fail400:
		// A client error no retry fixes: the conversation outgrew the
		// model's context window.
		writeError(w, http.StatusBadRequest, "invalid_request_error", "messages", "context_length_exceeded",
			fmt.Sprintf("This model's maximum context length is 4096 tokens. However, your messages resulted in %d tokens. Please reduce the length of the messages.", 4096+len(body)))
	case FailHang:
		// Hold the request open until the client gives up or the server
		// shuts down (which cancels the request context).
		<-ctx.Done()
	case FailMalformed:
		var probe struct {
			Stream bool `json:"stream"`
		}
		_ = json.Unmarshal(body, &probe)
		if probe.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, `data: {"id":"chatcmpl-malformed","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"The ans`+"\n\n")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"id":"chatcmpl-malformed","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"The ans`)
	}
}

// stream writes chunks as server-sent events, then [DONE].
func (s *Server) stream(ctx context.Context, w http.ResponseWriter, chunks []chatCompletion) error {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	send := func(data []byte) error {
		if _, err := fmt.Fprintf(w, "data: %s\n\n", data); err != nil {
			return fmt.Errorf("mockllm: writing SSE event: %w", err)
		}
		if err := rc.Flush(); err != nil {
			return fmt.Errorf("mockllm: flushing SSE event: %w", err)
		}
		return nil
	}
	for i, c := range chunks {
		if i > 0 && !sleep(ctx, s.opts.ChunkDelay) {
			return ctx.Err()
		}
		b, err := json.Marshal(c)
		if err != nil {
			return fmt.Errorf("mockllm: encoding chunk: %w", err)
		}
		if err := send(b); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return send([]byte("[DONE]"))
}

// sleep waits d or until ctx ends; it reports whether the wait completed.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// apiError is an OpenAI error body: {"error":{"message","type","param","code"}}.
type apiError struct {
	status  int
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) write(w http.ResponseWriter) {
	writeJSON(w, e.status, map[string]*apiError{"error": e})
}

func newAPIError(status int, typ, param, code, msg string) *apiError {
	e := &apiError{status: status, Message: msg, Type: typ}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	return e
}

func writeError(w http.ResponseWriter, status int, typ, param, code, msg string) {
	newAPIError(status, typ, param, code, msg).write(w)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, `{"error":{"message":"encoding response failed","type":"server_error","param":null,"code":null}}`, http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
