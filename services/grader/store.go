package grader

import (
	"sort"
	"sync"
	"time"

	"github.com/osmo-rl/osmo/internal/outcome"
)

// grading is one run of a grader over samples of one rollout: an outcome per
// sample, or one error for all of them. It is also the journal's line format.
type grading struct {
	RolloutID string    `json:"rollout_id"`
	Grader    string    `json:"grader"`
	GradedAt  time.Time `json:"graded_at"`
	Error     string    `json:"error,omitempty"`
	// Category classifies Error: timeout, validation_error or agent_error.
	Category outcome.Category `json:"category,omitempty"`
	Samples  []sampleResult   `json:"samples"`
}

// sampleResult is one sample's outcome. Reward is nil when the sample was
// removed or the grading failed.
type sampleResult struct {
	ID     string   `json:"id"`
	Reward *float64 `json:"reward,omitempty"`
	Remove bool     `json:"remove_sample,omitempty"`
	// Fingerprint is that of the sample as graded (see fingerprints). The
	// outcome answers only requests whose sample has the same one; journal
	// lines written before fingerprints have none and answer nothing.
	Fingerprint string `json:"fingerprint,omitempty"`
}

// answers reports whether r is the outcome of a sample with fingerprint fp.
func (r sampleResult) answers(fp string) bool {
	return r.Fingerprint != "" && r.Fingerprint == fp
}

func (g *grading) sample(id string) (sampleResult, bool) {
	for _, r := range g.Samples {
		if r.ID == id {
			return r, true
		}
	}
	return sampleResult{}, false
}

// without returns g less the samples ids covers (g itself when it covers
// none of them, nil when it covers nothing else). Gradings are shared once
// stored, so it copies rather than edits.
func (g *grading) without(ids map[string]bool) *grading {
	keep := make([]sampleResult, 0, len(g.Samples))
	for _, r := range g.Samples {
		if !ids[r.ID] {
			keep = append(keep, r)
		}
	}
	switch len(keep) {
	case len(g.Samples):
		return g
	case 0:
		return nil
	}
	c := *g
	c.Samples = keep
	return &c
}

// answer is what answers one sample: the grading that covered it.
type answer struct {
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

// add stores g, the latest grading of its samples: it replaces what earlier
// gradings of the rollout hold for them (a sample graded anew because its
// content differs from the stored grading's), so the store, and with it a
// compacted journal, keeps one outcome per sample.
func (s *store) add(g *grading) {
	ids := make(map[string]bool, len(g.Samples))
	for _, r := range g.Samples {
		ids[r.ID] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.byRollout[g.RolloutID]
	gs := make([]*grading, 0, len(old)+1)
	for _, o := range old {
		if o = o.without(ids); o != nil {
			gs = append(gs, o)
		}
	}
	s.n -= len(old) - len(gs)
	s.byRollout[g.RolloutID] = append(gs, g)
	s.n++
}

// lookup finds the unexpired outcomes of ids that answer their fingerprint
// in fps; missing lists, in order, the ids no live grading answers, and
// changed counts those of them that a live grading holds with another
// fingerprint (or none).
func (s *store) lookup(rolloutID string, ids []string, fps map[string]string, now time.Time) (found map[string]answer, missing []string, changed int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	found = make(map[string]answer, len(ids))
	gs := s.byRollout[rolloutID]
	for _, id := range ids {
		hit, held := false, false
		for _, g := range gs {
			if s.expired(g, now) {
				continue
			}
			if r, ok := g.sample(id); ok {
				held = true
				if r.answers(fps[id]) {
					found[id] = answer{g: g, r: r}
					hit = true
				}
				break
			}
		}
		if !hit {
			missing = append(missing, id)
			if held {
				changed++
			}
		}
	}
	return found, missing, changed
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
