package rollout

import (
	"sync"
	"time"
)

// store holds rollout records: by idempotency key (what makes init
// idempotent), by rollout id (lookups and routing), and the finished ones in
// completion order (what watchers replay).
type store struct {
	mu       sync.Mutex
	byKey    map[string]*record
	byID     map[string]*record
	finished []finishedRecord // ascending seq
	seq      int64
	active   int
	subs     map[*subscriber]struct{}
	// bytes is what the finished records hold; past maxBytes the oldest
	// are dropped, and dropped counts them by reason.
	bytes    int64
	maxBytes int64
	dropped  func(reason string)
}

// finishedRecord is a finished record and its size.
type finishedRecord struct {
	*record
	size int64
}

// Reasons a finished record is dropped.
const (
	dropTTL   = "ttl"
	dropBytes = "bytes"
)

func newStore(maxBytes int64, dropped func(reason string)) *store {
	return &store{byKey: map[string]*record{}, byID: map[string]*record{}, subs: map[*subscriber]struct{}{},
		maxBytes: maxBytes, dropped: dropped}
}

// admit returns the record already under key (dup == true), or inserts rec.
// A rollout id held by a different key is a conflict (ok == false).
func (s *store) admit(rec *record) (existing *record, dup, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, found := s.byKey[rec.key]; found {
		return old, true, true
	}
	if old, found := s.byID[rec.id]; found {
		return old, false, false
	}
	s.byKey[rec.key] = rec
	s.byID[rec.id] = rec
	s.active++
	return rec, false, true
}

// forget removes a record whose init failed, so a retry starts afresh.
func (s *store) forget(rec *record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.drop(rec)
	s.active--
}

// drop removes rec from the indexes where it is still the record. Caller
// holds mu.
func (s *store) drop(rec *record) {
	if s.byKey[rec.key] == rec {
		delete(s.byKey, rec.key)
	}
	if s.byID[rec.id] == rec {
		delete(s.byID, rec.id)
	}
}

func (s *store) get(id string) *record {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byID[id]
}

// finish gives rec, a finished record of size bytes, its completion
// sequence number and tells every watcher. Past the byte bound the oldest
// finished records are dropped (this one is always kept).
func (s *store) finish(rec *record, size int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	rec.setSeq(s.seq)
	s.finished = append(s.finished, finishedRecord{rec, int64(size)})
	s.bytes += int64(size)
	s.active--
	n := 0
	for s.bytes > s.maxBytes && n < len(s.finished)-1 {
		s.drop(s.finished[n].record)
		s.bytes -= s.finished[n].size
		s.finished[n] = finishedRecord{}
		s.dropped(dropBytes)
		n++
	}
	s.finished = s.finished[n:]
	for sub := range s.subs {
		select {
		case sub.ch <- rec:
		default:
			// A watcher that cannot keep up is cut off rather than allowed to
			// stall completions; it reconnects with after_sequence and replays.
			delete(s.subs, sub)
			close(sub.ch)
		}
	}
}

// held is how many finished records the store holds, and their bytes.
func (s *store) held() (int, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.finished), s.bytes
}

// counts returns how many admitted rollouts have not finished yet.
func (s *store) counts() (active int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.active
}

// prune drops finished records older than ttl.
func (s *store) prune(now time.Time, ttl time.Duration) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	keep := s.finished[:0]
	n := 0
	for _, f := range s.finished {
		if now.Sub(f.finishedAt()) < ttl {
			keep = append(keep, f)
			continue
		}
		s.drop(f.record)
		s.bytes -= f.size
		s.dropped(dropTTL)
		n++
	}
	for i := len(keep); i < len(s.finished); i++ {
		s.finished[i] = finishedRecord{}
	}
	s.finished = keep
	return n
}

type subscriber struct {
	ch chan *record
}

// subscribe registers a watcher and returns the finished records it should
// replay first: those with seq > after (none when after < 0). Both happen
// under one lock so nothing falls between replay and live delivery.
func (s *store) subscribe(after int64, buffer int) ([]*record, *subscriber) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var replay []*record
	if after >= 0 {
		for _, f := range s.finished {
			if f.sequence() > after {
				replay = append(replay, f.record)
			}
		}
	}
	sub := &subscriber{ch: make(chan *record, buffer)}
	s.subs[sub] = struct{}{}
	return replay, sub
}

func (s *store) unsubscribe(sub *subscriber) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.subs[sub]; ok {
		delete(s.subs, sub)
		close(sub.ch)
	}
}

// unfinished returns the unfinished records whose id matches.
func (s *store) unfinished(match func(id string) bool) []*record {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*record
	for id, rec := range s.byID {
		if match(id) && rec.finishedAt().IsZero() {
			out = append(out, rec)
		}
	}
	return out
}
