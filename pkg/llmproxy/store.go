package llmproxy

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/osmo-rl/osmo"
)

// Store is an in-memory Recorder that keeps calls by rollout id, for the
// standalone proxy server. It holds at most maxCalls calls in all and
// forgets calls older than ttl; the oldest go first.
type Store struct {
	maxCalls int
	ttl      time.Duration
	now      func() time.Time

	mu        sync.Mutex
	byRollout map[string][]*osmo.LLMCall
	// order lists stored calls oldest first, so eviction by count and by
	// age both pop from its head.
	order []storedRef
	head  int
}

type storedRef struct {
	rolloutID string
	at        time.Time
}

// NewStore returns a Store keeping at most maxCalls calls (<= 0: 10,000) for
// at most ttl (<= 0: forever).
func NewStore(maxCalls int, ttl time.Duration) *Store {
	if maxCalls <= 0 {
		maxCalls = 10000
	}
	return &Store{maxCalls: maxCalls, ttl: ttl, now: time.Now, byRollout: map[string][]*osmo.LLMCall{}}
}

// RecordCall implements Recorder. Calls without a rollout id are dropped:
// nobody can ask for them.
func (s *Store) RecordCall(_ context.Context, c *osmo.LLMCall) {
	if c == nil || c.RolloutID == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.pruneLocked(now)
	if len(s.order)-s.head >= s.maxCalls {
		s.popLocked()
	}
	s.byRollout[c.RolloutID] = append(s.byRollout[c.RolloutID], c)
	s.order = append(s.order, storedRef{rolloutID: c.RolloutID, at: now})
}

// Calls returns the stored calls of rolloutID, oldest first.
func (s *Store) Calls(rolloutID string) []*osmo.LLMCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pruneLocked(s.now())
	return append([]*osmo.LLMCall(nil), s.byRollout[rolloutID]...)
}

func (s *Store) pruneLocked(now time.Time) {
	if s.ttl <= 0 {
		return
	}
	for s.head < len(s.order) && now.Sub(s.order[s.head].at) > s.ttl {
		s.popLocked()
	}
}

// popLocked forgets the oldest call.
func (s *Store) popLocked() {
	ref := s.order[s.head]
	s.order[s.head] = storedRef{}
	s.head++
	calls := s.byRollout[ref.rolloutID]
	calls[0] = nil
	if len(calls) == 1 {
		delete(s.byRollout, ref.rolloutID)
	} else {
		s.byRollout[ref.rolloutID] = calls[1:]
	}
	// Compact once the consumed head dominates, keeping appends amortized.
	if s.head > 1024 && s.head*2 > len(s.order) {
		s.order = append(s.order[:0], s.order[s.head:]...)
		s.head = 0
	}
}

// ServeHTTP answers GET /r/{rollout_id}/calls with the rollout's calls as
// JSON: {"rollout_id": ..., "calls": [...]}. Messages are embedded as JSON.
// Mounted on a mux with that pattern it uses the path value; otherwise it
// parses the path itself.
func (s *Store) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeStoreError(w, http.StatusMethodNotAllowed, "method_not_allowed", "llmproxy: use GET /r/{rollout_id}/calls")
		return
	}
	id := r.PathValue("rollout_id")
	if id == "" {
		rest, ok := strings.CutPrefix(r.URL.EscapedPath(), "/r/")
		if rest, ok2 := strings.CutSuffix(rest, "/calls"); ok && ok2 && rest != "" && !strings.Contains(rest, "/") {
			id, _ = url.PathUnescape(rest)
		}
	}
	if id == "" {
		writeStoreError(w, http.StatusNotFound, "not_found", "llmproxy: use GET /r/{rollout_id}/calls")
		return
	}
	calls := s.Calls(id)
	out := struct {
		RolloutID string       `json:"rollout_id"`
		Calls     []listedCall `json:"calls"`
	}{RolloutID: id, Calls: make([]listedCall, 0, len(calls))}
	for _, c := range calls {
		out.Calls = append(out.Calls, listedCall{c.RolloutID, c.SampleID, c})
	}
	body, err := json.Marshal(out)
	if err != nil {
		writeStoreError(w, http.StatusInternalServerError, "internal_error", "llmproxy: encoding calls: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// listedCall is a recorded call as GET /r/{rollout_id}/calls lists it:
// the record, with the ids it is listed by.
type listedCall struct {
	RolloutID string `json:"rollout_id"`
	SampleID  string `json:"sample_id,omitempty"`
	*osmo.LLMCall
}

func writeStoreError(w http.ResponseWriter, status int, code, msg string) {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "invalid_request_error", "param": nil, "code": code}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
