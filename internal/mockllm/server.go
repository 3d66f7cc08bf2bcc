// Package mockllm is a deterministic OpenAI-compatible policy double. It
// stands in for a vLLM-served policy or a hosted provider in demos, tests and
// benchmarks: it answers /v1/chat/completions (JSON and SSE), solves
// arithmetic tasks by calling the tools it is offered one turn at a time (as
// tool_choice allows), reports usage, vLLM token ids and logprobs, and fails
// on demand the way real servers fail (5xx, 429 with Retry-After, hangs,
// malformed bodies).
//
// It also plays one engine of a policy plane: vLLM's weight-sync endpoints
// (POST /pause?mode=abort|wait|keep, POST /resume, GET /is_paused) with
// vLLM's semantics, a name on every answer (X-Engine-Id), and the faults of
// an engine fleet: a fraction of calls failing, a death mid-run.
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
	"sync"
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

// SessionHeader is the request header a policy plane sets to one value
// per sample; the mock logs it with each chat request.
const SessionHeader = "X-Session-ID"

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

	// The engine's part in a policy plane: its name, its faults, and
	// whether it has vLLM's weight-sync endpoints.

	// EngineID, when set, names the engine in the X-Engine-Id header of
	// every answer and in the completions' system_fingerprint.
	EngineID string
	// FailFraction makes each chat request fail with FailMode with this
	// probability, drawn from a source seeded with FailSeed (so a run
	// repeats).
	FailFraction float64
	FailSeed     uint64
	// DieAfter makes the engine die at its DieAfter-th chat request: that
	// request and every later one has its connection cut without an
	// answer, and Dead is closed (0: never).
	DieAfter int
	// PauseAPI is whose pause endpoints the engine serves: PauseAPIVLLM
	// (the default: POST /pause?mode=abort|wait|keep, POST /resume, GET
	// /is_paused), PauseAPISGLang (POST /pause_generation {"mode":
	// "abort"|"retract"|"in_place"}, POST /continue_generation) or
	// PauseAPINone (404, as vLLM outside its development mode).
	PauseAPI string
}

// The values of Options.PauseAPI.
const (
	PauseAPIVLLM   = "vllm"
	PauseAPISGLang = "sglang"
	PauseAPINone   = "none"
)

// Server is the mock policy; it is an http.Handler safe for concurrent use.
type Server struct {
	opts     Options
	requests atomic.Int64
	gate     *pauseGate
	draw     *failDraw
	dead     chan struct{}
	dieOnce  sync.Once
}

var _ http.Handler = (*Server)(nil)

// New validates opts and returns a Server.
func New(opts Options) (*Server, error) {
	opts.Model = cmp.Or(opts.Model, DefaultModel)
	opts.MaxRequestBytes = cmp.Or(opts.MaxRequestBytes, DefaultMaxRequestBytes)
	opts.PauseAPI = cmp.Or(opts.PauseAPI, PauseAPIVLLM)
	switch {
	case opts.PauseAPI != PauseAPIVLLM && opts.PauseAPI != PauseAPISGLang && opts.PauseAPI != PauseAPINone:
		return nil, fmt.Errorf("mockllm: unknown PauseAPI %q (want vllm, sglang or none)", opts.PauseAPI)
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
	case opts.FailMode != "" && opts.FailEvery == 0 && opts.FailFirst == 0 && opts.FailFraction == 0:
		// Silently never failing would make a misconfigured test pass.
		return nil, fmt.Errorf("mockllm: FailMode %q needs FailEvery, FailFirst or FailFraction to select requests", opts.FailMode)
	case opts.FailMode == "" && (opts.FailEvery != 0 || opts.FailFirst != 0 || opts.FailFraction != 0):
		return nil, errors.New("mockllm: FailEvery, FailFirst and FailFraction need a FailMode")
	}
	if err := validateEngine(opts); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Server{opts: opts, gate: newPauseGate(), draw: newFailDraw(opts.FailSeed), dead: make(chan struct{})}, nil
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
	if s.opts.EngineID != "" {
		w.Header().Set(EngineHeader, s.opts.EngineID)
	}
	vllm, sglang := s.opts.PauseAPI == PauseAPIVLLM, s.opts.PauseAPI == PauseAPISGLang
	switch {
	case vllm && p == "/pause":
		s.only(w, r, http.MethodPost, func() { s.servePause(w, r) })
	case vllm && p == "/resume", sglang && p == "/continue_generation":
		s.only(w, r, http.MethodPost, func() { s.serveResume(w, r) })
	case sglang && p == "/pause_generation":
		s.only(w, r, http.MethodPost, func() { s.servePauseGeneration(w, r) })
	case vllm && p == "/is_paused":
		s.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, map[string]bool{"is_paused": s.gate.isPaused()}) })
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
	if s.opts.EngineID != "" {
		log = log.With("engine", s.opts.EngineID)
	}
	if s.opts.DieAfter > 0 && n >= int64(s.opts.DieAfter) {
		s.dieOnce.Do(func() {
			log.WarnContext(ctx, "mockllm: engine dies", "die_after", s.opts.DieAfter)
			close(s.dead)
		})
		// The connection is cut with no answer, as when the process dies.
		panic(http.ErrAbortHandler)
	}
	if id := r.Header.Get("X-Rollout-Id"); id != "" {
		log = log.With("rollout_id", id)
	}
	if id := r.Header.Get("X-Sample-Id"); id != "" {
		log = log.With("sample_id", id)
	}
	if id := r.Header.Get(SessionHeader); id != "" {
		// The plane's affinity key, as engines' own routers read it.
		log = log.With("session_id", id)
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
	if mode == "" && s.fails(n) {
		mode = s.opts.FailMode
	}
	if !validFailMode(mode) {
		writeError(w, http.StatusBadRequest, "invalid_request_error", FailHeader, "invalid_value",
			fmt.Sprintf("%s: unknown failure mode %q (want 500, 503, 429, 400, hang or malformed)", FailHeader, mode))
		return
	}
	aborted, release, err := s.gate.admit(ctx)
	if err != nil {
		return
	}
	defer release()
	if !sleepUnless(ctx, s.opts.Latency, aborted) {
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
	if s.opts.EngineID != "" {
		res.fingerprint = "fp_osmo_mock_" + s.opts.EngineID
	}
	log.DebugContext(ctx, "mockllm: chat completion", "stream", req.Stream, "finish_reason", res.finish,
		"prompt_tokens", len(res.promptIDs), "completion_tokens", len(res.pieces))
	if !req.Stream {
		// The whole answer is generated at once, after Latency; a keep
		// pause holds it, an abort pause ends it empty.
		abort, err := s.gate.step(ctx, aborted)
		if err != nil {
			return
		}
		if abort {
			log.InfoContext(ctx, "mockllm: request aborted by a pause")
			res.abort(0)
		}
		writeJSON(w, http.StatusOK, res.completion())
		return
	}
	chunks := res.chunks(req.includeUsage())
	next := func(i int) (bool, error) {
		if i > 0 && !sleepUnless(ctx, s.opts.ChunkDelay, aborted) {
			return false, ctx.Err()
		}
		return s.gate.step(ctx, aborted)
	}
	if err := s.stream(ctx, w, chunks, next, res); err != nil {
		log.DebugContext(ctx, "mockllm: stream ended early", "error", err)
	}
}

// fails reports whether the n-th chat request fails with FailMode.
func (s *Server) fails(n int64) bool {
	if s.opts.FailMode == "" {
		return false
	}
	return n <= int64(s.opts.FailFirst) || s.opts.FailEvery > 0 && n%int64(s.opts.FailEvery) == 0 || s.draw.below(s.opts.FailFraction)
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

// stream writes chunks as server-sent events, then [DONE]. next is asked
// before each chunk; when it reports an abort, the stream ends with res's
// abort chunk (finish_reason "abort") and [DONE], as vLLM ends a request a
// pause aborted.
func (s *Server) stream(ctx context.Context, w http.ResponseWriter, chunks []chatCompletion, next func(int) (bool, error), res *response) error {
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
		aborted, err := next(i)
		if err != nil {
			return err
		}
		if aborted && i > 0 {
			c = res.abortChunk()
		}
		b, err := json.Marshal(c)
		if err != nil {
			return fmt.Errorf("mockllm: encoding chunk: %w", err)
		}
		if err := send(b); err != nil {
			return err
		}
		if aborted && i > 0 {
			break
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return send([]byte("[DONE]"))
}

// sleepUnless waits d, until ctx ends or until aborted is closed (the
// request is then answered as aborted); it reports whether ctx is still
// live.
func sleepUnless(ctx context.Context, d time.Duration, aborted <-chan struct{}) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-aborted:
		return ctx.Err() == nil
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
