package mockllm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
)

// Pause modes of POST /pause?mode=…, as vLLM names them.
const (
	// PauseAbort ends every request in flight at once with what it has
	// generated so far and finish_reason "abort"; new requests wait for
	// the resume. It is vLLM's default mode.
	PauseAbort = "abort"
	// PauseWait lets the requests in flight finish; the pause's answer
	// comes once they have. New requests wait for the resume.
	PauseWait = "wait"
	// PauseKeep freezes the requests in flight where they are (no more
	// tokens, no answer) and holds new ones; all go on after the resume.
	PauseKeep = "keep"
)

// EngineHeader names the engine (Options.EngineID) on every answer.
const EngineHeader = "X-Engine-Id"

// finishAbort is the finish_reason vLLM gives a request a pause aborted.
const finishAbort = "abort"

// pauseGate is the engine's scheduler as far as weight sync sees it:
// whether generation is paused and how, and which requests are in flight.
type pauseGate struct {
	mu     sync.Mutex
	paused bool
	keep   bool
	// resumed is closed by the resume that ends the current pause.
	resumed chan struct{}
	// aborted is closed by the next abort; a request keeps the channel
	// current when it was admitted, so later requests are not aborted.
	aborted  chan struct{}
	inflight int
	// drained is closed when inflight next reaches 0 (nil: nobody waits).
	drained chan struct{}
}

func newPauseGate() *pauseGate {
	return &pauseGate{aborted: make(chan struct{})}
}

// admit waits while generation is paused, then counts the request in
// flight. It returns the channel an abort pause closes and the release the
// request must call when it ends.
func (g *pauseGate) admit(ctx context.Context) (<-chan struct{}, func(), error) {
	for {
		g.mu.Lock()
		if !g.paused {
			g.inflight++
			aborted := g.aborted
			g.mu.Unlock()
			return aborted, g.release, nil
		}
		resumed := g.resumed
		g.mu.Unlock()
		select {
		case <-resumed:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
}

func (g *pauseGate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inflight--
	if g.inflight == 0 && g.drained != nil {
		close(g.drained)
		g.drained = nil
	}
}

// step is called before each piece of an answer: it reports whether the
// request was aborted, and while a keep pause lasts it waits.
func (g *pauseGate) step(ctx context.Context, aborted <-chan struct{}) (bool, error) {
	for {
		select {
		case <-aborted:
			return true, nil
		default:
		}
		g.mu.Lock()
		frozen, resumed := g.paused && g.keep, g.resumed
		g.mu.Unlock()
		if !frozen {
			return false, ctx.Err()
		}
		select {
		case <-resumed:
		case <-aborted:
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// pause applies mode; under wait it returns once the requests in flight
// have finished (or ctx ends, the engine staying paused).
func (g *pauseGate) pause(ctx context.Context, mode string) error {
	g.mu.Lock()
	if !g.paused {
		g.paused = true
		g.resumed = make(chan struct{})
	}
	g.keep = mode == PauseKeep
	if mode == PauseAbort {
		close(g.aborted)
		g.aborted = make(chan struct{})
	}
	if mode != PauseWait || g.inflight == 0 {
		g.mu.Unlock()
		return nil
	}
	if g.drained == nil {
		g.drained = make(chan struct{})
	}
	drained := g.drained
	g.mu.Unlock()
	select {
	case <-drained:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (g *pauseGate) resume() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused {
		g.paused, g.keep = false, false
		close(g.resumed)
	}
}

func (g *pauseGate) isPaused() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused
}

// servePause answers POST /pause as vLLM does: mode abort (the default),
// wait or keep; the deprecated wait_for_inflight_requests=true means wait.
// An unknown mode is 422 naming the query parameter, like FastAPI's
// validation.
func (s *Server) servePause(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	mode := q.Get("mode")
	if mode == "" {
		mode = PauseAbort
		if q.Get("wait_for_inflight_requests") == "true" {
			mode = PauseWait
		}
	}
	if mode != PauseAbort && mode != PauseWait && mode != PauseKeep {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"detail": []any{map[string]any{
			"type": "literal_error", "loc": []string{"query", "mode"}, "input": mode,
			"msg": "Input should be 'abort', 'wait' or 'keep'",
		}}})
		return
	}
	s.pause(w, r, mode)
}

// pause pauses generation in mode and answers once it is paused.
func (s *Server) pause(w http.ResponseWriter, r *http.Request, mode string) {
	if err := s.gate.pause(r.Context(), mode); err != nil {
		// The client left before the requests in flight finished.
		return
	}
	s.opts.Logger.InfoContext(r.Context(), "mockllm: generation paused", "mode", mode, "engine", s.opts.EngineID)
	writeJSON(w, http.StatusOK, map[string]string{"status": "paused"})
}

// servePauseGeneration is SGLang's pause: abort ends the requests in
// flight; retract (back to the queue) and in_place (frozen where they
// are) both have them finish after the resume, as keep does.
func (s *Server) servePauseGeneration(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Mode string `json:"mode"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<10)).Decode(&body); err != nil && !errors.Is(err, io.EOF) {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "invalid_json", "pause_generation: "+err.Error())
		return
	}
	mode := PauseKeep
	switch body.Mode {
	case "abort", "":
		mode = PauseAbort
	case "retract", "in_place":
	default:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "mode", "invalid_mode",
			fmt.Sprintf("pause_generation: mode must be abort, retract or in_place, got %q", body.Mode))
		return
	}
	s.pause(w, r, mode)
}

func (s *Server) serveResume(w http.ResponseWriter, r *http.Request) {
	s.gate.resume()
	s.opts.Logger.InfoContext(r.Context(), "mockllm: generation resumed", "engine", s.opts.EngineID)
	writeJSON(w, http.StatusOK, map[string]string{"status": "resumed"})
}

// Paused reports whether generation is paused.
func (s *Server) Paused() bool { return s.gate.isPaused() }

// Dead is closed when the request numbered Options.DieAfter arrives: the
// engine has died, and whoever serves it should close its listener and
// connections (osmo mockllm does, then exits or comes back).
func (s *Server) Dead() <-chan struct{} { return s.dead }

// failDraw is a fraction-of-calls fault drawn from the seeded source.
type failDraw struct {
	mu  sync.Mutex
	rng *rand.Rand
}

func newFailDraw(seed uint64) *failDraw {
	return &failDraw{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (d *failDraw) below(p float64) bool {
	if p <= 0 {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rng.Float64() < p
}

func validateEngine(opts Options) error {
	switch {
	case opts.FailFraction < 0 || opts.FailFraction > 1:
		return fmt.Errorf("mockllm: FailFraction must be within [0, 1], got %v", opts.FailFraction)
	case opts.DieAfter < 0:
		return fmt.Errorf("mockllm: DieAfter must not be negative, got %d", opts.DieAfter)
	}
	return nil
}

// InFlight reports how many chat requests are admitted and not yet
// answered (those a pause holds at the door are not counted).
func (s *Server) InFlight() int {
	s.gate.mu.Lock()
	defer s.gate.mu.Unlock()
	return s.gate.inflight
}
