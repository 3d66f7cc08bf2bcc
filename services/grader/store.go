package grader

import (
	"sort"
	"sync"
	"time"
)

// grading is one run of a grader over samples of one rollout: an outcome per
// sample, or one error for all of them. It is also the journal's line format.
type grading struct {
	RolloutID string    `json:"rollout_id"`
	Grader    string    `json:"grader"`
	GradedAt  time.Time `json:"graded_at"`
	Error     string    `json:"error,omitempty"`
	// Category classifies Error: timeout, validation_error or agent_error.
	Category string         `json:"category,omitempty"`
	Samples  []sampleResult `json:"samples"`
}

// sampleResult is one sample's outcome. Reward is nil when the sample was
// removed or the grading failed.
type sampleResult struct {
	ID     string   `json:"id"`
	Reward *float64 `json:"reward,omitempty"`
	Remove bool     `json:"remove_sample,omitempty"`
}

func (g *grading) sample(id string) (sampleResult, bool) {
	for _, r := range g.Samples {
		if r.ID == id {
			return r, true
		}
	}
	return sampleResult{}, false
}

// outcome is what answers one sample: the grading that covered it.
type outcome struct {
	g     *grading
	r     sampleResult
	fresh bool // graded for this very request
}

// store keeps gradings in memory for ttl, by rollout.
type store struct {
	ttl time.Duration

	mu        sync.Mutex
	byRollout map[string][]*grading
	n         int
}

func newStore(ttl time.Duration) *store {
	return &store{ttl: ttl, byRollout: map[string][]*grading{}}
}

func (s *store) expired(g *grading, now time.Time) bool {
	return now.Sub(g.GradedAt) >= s.ttl
}

func (s *store) add(g *grading) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byRollout[g.RolloutID] = append(s.byRollout[g.RolloutID], g)
	s.n++
}

// lookup finds the unexpired outcomes of ids; missing lists, in order, the
// ids no live grading covers.
func (s *store) lookup(rolloutID string, ids []string, now time.Time) (found map[string]outcome, missing []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	found = make(map[string]outcome, len(ids))
	gs := s.byRollout[rolloutID]
	for _, id := range ids {
		hit := false
		for _, g := range gs {
			if s.expired(g, now) {
				continue
			}
			if r, ok := g.sample(id); ok {
				found[id] = outcome{g: g, r: r}
				hit = true
				break
			}
		}
		if !hit {
			missing = append(missing, id)
		}
	}
	return found, missing
}

// prune drops expired gradings and reports how many it dropped.
func (s *store) prune(now time.Time) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	dropped := 0
	for id, gs := range s.byRollout {
		live := gs[:0]
		for _, g := range gs {
			if s.expired(g, now) {
				dropped++
				continue
			}
			live = append(live, g)
		}
		clear(gs[len(live):])
		if len(live) == 0 {
			delete(s.byRollout, id)
		} else {
			s.byRollout[id] = live
		}
	}
	s.n -= dropped
	return dropped
}

func (s *store) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// snapshot returns the live gradings, oldest first.
func (s *store) snapshot(now time.Time) []*grading {
	s.mu.Lock()
	out := make([]*grading, 0, s.n)
	for _, gs := range s.byRollout {
		for _, g := range gs {
			if !s.expired(g, now) {
				out = append(out, g)
			}
		}
	}
	s.mu.Unlock()
	sort.SliceStable(out, func(i, j int) bool { return out[i].GradedAt.Before(out[j].GradedAt) })
	return out
}
