package rollout

import "sync"

// store holds the records of the rollouts this replica runs or concludes.
type store struct {
	mu   sync.Mutex
	byID map[string]*record
}

func newStore() *store { return &store{byID: map[string]*record{}} }

func (s *store) add(rec *record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byID[rec.id] = rec
}

// addNew adds rec unless its id has a record here, and reports whether
// it did.
func (s *store) addNew(rec *record) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.byID[rec.id]; ok {
		return false
	}
	s.byID[rec.id] = rec
	return true
}

// remove lets go of rec (not of a newer record under its id).
func (s *store) remove(rec *record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byID[rec.id] == rec {
		delete(s.byID, rec.id)
	}
}

func (s *store) get(id string) *record {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byID[id]
}

// counts is how many rollouts this replica holds.
func (s *store) counts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.byID)
}
