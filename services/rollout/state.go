package rollout

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/wal"
)

// The state log (--state DIR) is what a rollout server must not forget
// across a crash: every rollout it accepted, the callbacks each owes, and
// which of those are done. Its entries, in the order they happen:
//
//	accepted   the wire's request, on disk before the trainer is answered
//	owed       a stage's callbacks (their bodies, URLs, bearers) and the
//	           outcome they report, on disk before the first is posted
//	delivered  one of those callbacks done with (delivered, refused for
//	           good, or given up on at the delivery deadline)
//	finished   the rollout's final status, kept while its record is, so a
//	           duplicate start and a status query are answered after a
//	           restart too
//
// After a restart every rollout accepted and not finished ends with its
// callbacks: those owed and not done are delivered again, and one that had
// not reached a stage (queued, running or grading when the server died)
// reports a failure (agent_error) saying it was interrupted by a restart.
// So every accepted rollout gets its terminal callbacks, once (a callback
// the trainer accepted in the instant before a crash, not yet marked done,
// is the one that can arrive twice).
//
// The log holds bearer tokens (the trainer's callback and LLM keys): it is
// created 0600 in a 0700 directory.
type stateLog struct {
	wal *wal.Log
	log *slog.Logger
	// compactAt is the size past which the log is rewritten with only
	// what is live; after each rewrite it is twice what was kept, and never
	// less than minCompact.
	minCompact int64
	mu         sync.Mutex
	compactAt  int64
	compacting bool
	// retained reports whether the store still holds a finished rollout:
	// its finished entry is kept while it does.
	retained func(id string) bool
	// syncs observes how long each waited-for append took (nil: not
	// observed).
	syncs prometheus.Observer
}

// stateFile is the log's name in the state directory.
const stateFile = "rollouts.wal"

// DefaultStateCompactBytes is the state log size past which it is first
// compacted.
const DefaultStateCompactBytes = 64 << 20

// Entry operations and stages of the state log.
const (
	opAccepted  = "accepted"
	opOwed      = "owed"
	opDelivered = "delivered"
	opFinished  = "finished"

	stageRan   = "ran"
	stageFinal = "final"
)

// stateEntry is one entry of the log, JSON-encoded.
type stateEntry struct {
	Op string `json:"op"`
	ID string `json:"id"`
	// Rollout: accepted (with the request) and finished (without).
	Rollout *savedRollout `json:"rollout,omitempty"`
	// Stage: owed and delivered; Outcome and Callbacks: owed; Index:
	// delivered.
	Stage     string          `json:"stage,omitempty"`
	Outcome   *savedOutcome   `json:"outcome,omitempty"`
	Reward    *float64        `json:"reward,omitempty"`
	Callbacks []savedCallback `json:"callbacks,omitempty"`
	Index     int             `json:"index,omitempty"`
}

// savedRollout is a rollout as the log keeps it.
type savedRollout struct {
	Key     string    `json:"key"`
	Wire    string    `json:"wire"`
	Created time.Time `json:"created"`
	// Request is the wire's request (proto): InitRolloutRequest for G1,
	// StartRolloutRequest for G2 and v0.3. Response is G1's init answer.
	Request  []byte `json:"request,omitempty"`
	Response []byte `json:"response,omitempty"`
	// Finished, Workflow and Reward: finished entries.
	Finished time.Time     `json:"finished,omitzero"`
	Workflow string        `json:"workflow,omitempty"`
	Reward   *float64      `json:"reward,omitempty"`
	Outcome  *savedOutcome `json:"outcome,omitempty"`
}

type savedOutcome struct {
	State    rolloutv1.State  `json:"state"`
	Category outcome.Category `json:"category,omitempty"`
	Message  string           `json:"message,omitempty"`
}

func saveOutcome(o outcome.Outcome) *savedOutcome {
	return &savedOutcome{State: o.State, Category: o.Category, Message: o.Message}
}

func (o *savedOutcome) outcome() outcome.Outcome {
	return outcome.Outcome{State: o.State, Category: o.Category, Message: o.Message}
}

// savedCallback is a delivery as the log keeps it: its policy is the
// wire's (wire.retry).
type savedCallback struct {
	Event   string          `json:"event"`
	Route   string          `json:"route"`
	URL     string          `json:"url"`
	Bearer  string          `json:"bearer,omitempty"`
	Status  string          `json:"status"`
	Payload json.RawMessage `json:"payload"`
}

// openState opens the state log in dir.
func openState(dir string, minCompact int64, log *slog.Logger) (*stateLog, [][]byte, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("rollout: state: %w", err)
	}
	w, entries, rec, err := wal.Open(filepath.Join(dir, stateFile), 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("rollout: state: %w", err)
	}
	if rec.Cut > 0 {
		log.Error("state log: dropped what follows the last whole entry (the entry a crash cut short, or damage)",
			"path", filepath.Join(dir, stateFile), "entries", rec.Entries, "offset", rec.Offset, "bytes", rec.Cut, "reason", rec.Reason, "saved_to", rec.SavedTo)
	}
	return &stateLog{wal: w, log: log, minCompact: minCompact, compactAt: minCompact}, entries, nil
}

// append writes e and returns once it is on disk; mark hands it to the
// log without waiting. Either starts a compaction when the log has grown
// past its mark. A nil log (no --state) takes nothing.
func (l *stateLog) append(e *stateEntry) error { return l.write(e, true) }
func (l *stateLog) mark(e *stateEntry) error   { return l.write(e, false) }

func (l *stateLog) write(e *stateEntry, wait bool) error {
	if l == nil {
		return nil
	}
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	if wait {
		t0 := time.Now()
		err = l.wal.Append(b)
		if l.syncs != nil {
			l.syncs.Observe(time.Since(t0).Seconds())
		}
	} else {
		err = l.wal.Enqueue(b)
	}
	if err != nil {
		return err
	}
	l.maybeCompact()
	return nil
}

func (l *stateLog) accepted(rec *record) error {
	if l == nil {
		return nil
	}
	req, resp := rec.wire.saved()
	sv := &savedRollout{Key: rec.key, Wire: rec.wire.name(), Created: rec.created}
	var err error
	if sv.Request, err = proto.Marshal(req); err != nil {
		return err
	}
	if resp != nil {
		if sv.Response, err = proto.Marshal(resp); err != nil {
			return err
		}
	}
	return l.append(&stateEntry{Op: opAccepted, ID: rec.id, Rollout: sv})
}

func (l *stateLog) owed(rec *record, stage string, o outcome.Outcome, ds []delivery) error {
	if l == nil {
		return nil
	}
	e := &stateEntry{Op: opOwed, ID: rec.id, Stage: stage, Outcome: saveOutcome(o), Callbacks: make([]savedCallback, len(ds))}
	if stage == stageFinal {
		rec.mu.Lock()
		e.Reward = rec.reward
		rec.mu.Unlock()
	}
	for i, d := range ds {
		e.Callbacks[i] = savedCallback{Event: d.event, Route: d.route, URL: d.url, Bearer: d.bearer, Status: d.status, Payload: d.payload}
	}
	return l.append(e)
}

// delivered and finished are marks: the rollout's goroutine does not wait
// for their fsync. Lost in a crash (only an entry not yet written is: the
// writer writes each batch at once), the callback they mark done is sent
// again, the same bytes, which is what at-least-once delivery allows; the
// entries a restart relies on to report each rollout once (accepted, owed)
// are on disk before the trainer hears anything.
func (l *stateLog) delivered(id, stage string, i int) error {
	return l.mark(&stateEntry{Op: opDelivered, ID: id, Stage: stage, Index: i})
}

func (l *stateLog) finished(rec *record) error {
	if l == nil {
		return nil
	}
	_, resp := rec.wire.saved()
	rec.mu.Lock()
	sv := &savedRollout{Key: rec.key, Wire: rec.wire.name(), Created: rec.created, Finished: rec.finished,
		Workflow: rec.workflow, Reward: rec.reward, Outcome: saveOutcome(rec.out)}
	rec.mu.Unlock()
	if resp != nil {
		var err error
		if sv.Response, err = proto.Marshal(resp); err != nil {
			return err
		}
	}
	return l.mark(&stateEntry{Op: opFinished, ID: rec.id, Rollout: sv})
}

func (l *stateLog) close() error {
	if l == nil {
		return nil
	}
	return l.wal.Close()
}

// maybeCompact rewrites the log in the background once it has grown past
// its mark, one rewrite at a time.
func (l *stateLog) maybeCompact() {
	l.mu.Lock()
	if l.compacting || l.wal.Size() < l.compactAt {
		l.mu.Unlock()
		return
	}
	l.compacting = true
	l.mu.Unlock()
	go func() {
		err := l.compact()
		l.mu.Lock()
		defer l.mu.Unlock()
		l.compacting = false
		l.compactAt = max(l.minCompact, 2*l.wal.Size())
		if err != nil && !errors.Is(err, wal.ErrClosed) {
			l.log.Error("state log: compaction failed; the log keeps growing until one succeeds", "error", err)
		}
	}()
}

// compact rewrites the log with what is live: the entries of every
// rollout not finished, and the finished entry of those the store still
// holds.
func (l *stateLog) compact() error {
	before := l.wal.Size()
	err := l.wal.Rewrite(func(entries [][]byte) [][]byte { return live(entries, l.retained) })
	if err == nil {
		l.log.Info("state log compacted", "bytes_before", before, "bytes_after", l.wal.Size())
	}
	return err
}

// live is the part of entries a restart needs. A rollout id can come back
// after its record was let go (a new rollout under an old id): only what
// follows its last finished entry belongs to the current one.
func live(entries [][]byte, retained func(id string) bool) [][]byte {
	heads := make([]stateHead, len(entries))
	lastFinished := map[string]int{}
	for i, b := range entries {
		if json.Unmarshal(b, &heads[i]) != nil {
			heads[i] = stateHead{}
			continue
		}
		if heads[i].Op == opFinished {
			lastFinished[heads[i].ID] = i
		}
	}
	var keep [][]byte
	for i, b := range entries {
		h := heads[i]
		if h.ID == "" {
			continue // not an entry of ours: it was reported when read
		}
		last, done := lastFinished[h.ID]
		switch {
		case h.Op == opFinished:
			if i == last && retained(h.ID) {
				keep = append(keep, b)
			}
		case !done || i > last:
			keep = append(keep, b)
		}
	}
	return keep
}

// stateHead is what compaction reads of an entry.
type stateHead struct {
	Op string `json:"op"`
	ID string `json:"id"`
}

// replayed is one rollout as the log tells it.
type replayed struct {
	id       string
	accepted *savedRollout
	stages   map[string]*owedStage
	finished *savedRollout
}

// owedStage is a stage's callbacks and which are done.
type owedStage struct {
	outcome   outcome.Outcome
	reward    *float64
	callbacks []savedCallback
	done      []bool
}

// replay reads the log's entries into the rollouts they tell of, in the
// order they were accepted. Entries it cannot read are reported and
// skipped.
func replay(entries [][]byte, log *slog.Logger) []*replayed {
	byID := map[string]*replayed{}
	var order []*replayed
	bad := 0
	for _, b := range entries {
		var e stateEntry
		if err := json.Unmarshal(b, &e); err != nil || e.ID == "" {
			bad++
			continue
		}
		r := byID[e.ID]
		if r == nil || (e.Op == opAccepted && r.finished != nil) {
			// A new rollout, or a new one under the id of a finished one.
			r = &replayed{id: e.ID, stages: map[string]*owedStage{}}
			byID[e.ID] = r
			order = append(order, r)
		}
		switch e.Op {
		case opAccepted:
			r.accepted = e.Rollout
		case opOwed:
			if e.Outcome == nil {
				bad++
				continue
			}
			r.stages[e.Stage] = &owedStage{outcome: e.Outcome.outcome(), reward: e.Reward, callbacks: e.Callbacks, done: make([]bool, len(e.Callbacks))}
		case opDelivered:
			if st := r.stages[e.Stage]; st != nil && e.Index >= 0 && e.Index < len(st.done) {
				st.done[e.Index] = true
			}
		case opFinished:
			r.finished = e.Rollout
		default:
			bad++
		}
	}
	if bad > 0 {
		log.Error("state log: entries that could not be read were skipped", "count", bad)
	}
	// A rollout replaced by a later one under its id is gone: its record
	// was let go before the new one was accepted.
	out := order[:0]
	for _, r := range order {
		if byID[r.id] == r {
			out = append(out, r)
		}
	}
	return out
}

// recoverState rebuilds what the log tells of: finished rollouts become
// records again (status and idempotency), and every other accepted one
// resumes at the stage it had reached. It runs in New, before anything is
// served, so a duplicate start is recognized from the first request; the
// resumed rollouts' deliveries start with Serve.
func (s *Service) recoverState(entries [][]byte) {
	var finished, resumed int
	for _, r := range replay(entries, s.log) {
		switch {
		case r.finished != nil:
			if err := s.restoreFinished(r.id, r.finished); err != nil {
				s.log.Error("state log: a finished rollout could not be restored", "rollout_id", r.id, "error", err)
				continue
			}
			finished++
		case r.accepted != nil:
			rec, err := s.restore(r.id, r.accepted)
			if err != nil {
				s.log.Error("state log: an accepted rollout could not be restored", "rollout_id", r.id, "error", err)
				continue
			}
			if _, dup, ok := s.store.admit(rec); dup || !ok {
				rec.release()
				continue
			}
			resumed++
			s.resumes = append(s.resumes, func() { s.resume(rec, r) })
		}
	}
	if finished+resumed > 0 {
		s.log.Info("state log replayed", "finished", finished, "resumed", resumed)
	}
}

// restore rebuilds an accepted rollout's record from its request.
func (s *Service) restore(id string, sv *savedRollout) (*record, error) {
	var rec *record
	switch sv.Wire {
	case wireG1:
		req := &rolloutv1.InitRolloutRequest{}
		if err := proto.Unmarshal(sv.Request, req); err != nil {
			return nil, err
		}
		var w *g1Wire
		rec, w = s.g1Record(req, sv.Key)
		w.resp = &rolloutv1.InitRolloutResponse{}
		if err := proto.Unmarshal(sv.Response, w.resp); err != nil {
			rec.release()
			return nil, err
		}
		close(w.ready)
	case wireG2, wireV03:
		req := &rolloutv1.StartRolloutRequest{}
		if err := proto.Unmarshal(sv.Request, req); err != nil {
			return nil, err
		}
		rec = s.g2Record(req, id)
	default:
		return nil, fmt.Errorf("unknown wire %q", sv.Wire)
	}
	rec.created = sv.Created
	return rec, nil
}

// restoreFinished enters a finished rollout as a frozen record: what
// status, GetRollout (without its samples, which went to the trainer) and
// a duplicate start read.
func (s *Service) restoreFinished(id string, sv *savedRollout) error {
	if sv.Outcome == nil {
		return errors.New("no outcome")
	}
	var w wire
	switch sv.Wire {
	case wireG1:
		g1 := &g1Wire{ready: make(chan struct{}), resp: &rolloutv1.InitRolloutResponse{}}
		if err := proto.Unmarshal(sv.Response, g1.resp); err != nil {
			return err
		}
		close(g1.ready)
		w = g1
	case wireG2:
		w = &g2Wire{id: id}
	case wireV03:
		w = &v03Wire{&g2Wire{id: id}}
	default:
		return fmt.Errorf("unknown wire %q", sv.Wire)
	}
	o := sv.Outcome.outcome()
	rec := &record{
		id: id, key: sv.Key, wire: w, workflow: sv.Workflow, created: sv.Created,
		state: o.State, out: o, final: true, reward: sv.Reward, finished: sv.Finished,
	}
	rec.initContexts(s.rolloutsCtx)
	rec.release()
	r := &rolloutv1.Rollout{
		RolloutId: id, State: o.State, Workflow: sv.Workflow, Reward: sv.Reward,
		ErrorMessage: o.Message, ErrorCategory: string(o.Category), Wire: sv.Wire,
		CreatedAt: timestamppb.New(sv.Created), FinishedAt: timestamppb.New(sv.Finished),
	}
	b, err := proto.Marshal(r)
	if err != nil {
		return err
	}
	rec.frozen = b
	if _, dup, ok := s.store.admit(rec); dup || !ok {
		return errors.New("already held")
	}
	s.store.finish(rec, len(b)+recordOverhead)
	return nil
}

// resume ends a rollout the server was running when it stopped: each stage
// whose callbacks were owed delivers those not done, and the first stage
// never reached reports the rollout interrupted by the restart.
func (s *Service) resume(rec *record, r *replayed) {
	log := s.log.With("rollout_id", rec.id, "wire", rec.wire.name())
	defer func() {
		if err := rec.log.close(); err != nil {
			log.Warn("event log", "error", err)
		}
	}()
	interrupted := func(when string) outcome.Outcome {
		return outcome.Failed(outcome.Agent, "interrupted by a restart of the rollout service %s", when)
	}
	how := recoveredRedelivered
	if r.stages[stageFinal] == nil {
		how = recoveredInterrupted
	}
	s.metrics.recovered.WithLabelValues(how).Inc()
	stage := func(name string, o outcome.Outcome, owed func() []delivery) {
		st := r.stages[name]
		if st == nil {
			s.deliver(rec, name, o, owed(), log)
			return
		}
		ds := make([]delivery, len(st.callbacks))
		for i, c := range st.callbacks {
			ds[i] = delivery{event: c.Event, route: c.Route, url: c.URL, bearer: c.Bearer, status: c.Status, payload: c.Payload, policy: rec.wire.retry()}
		}
		s.redeliver(rec, name, ds, st.done, log)
	}

	run := interrupted("while the rollout was queued or running")
	if st := r.stages[stageRan]; st != nil {
		run = st.outcome
	}
	if !run.OK() {
		rec.settle(run)
	}
	log.Warn("resuming a rollout accepted before a restart", "resumed_as", how)
	stage(stageRan, run, func() []delivery { return rec.wire.ran(rec, run) })
	final := run
	var reward *float64
	if st := r.stages[stageFinal]; st != nil {
		final, reward = st.outcome, st.reward
	} else if run.OK() {
		final = interrupted("while the rollout was being graded")
	}
	rec.settle(final)
	if final.OK() {
		// The samples went with the callbacks; the reward they carried
		// is what status reports.
		rec.mu.Lock()
		rec.reward = reward
		rec.mu.Unlock()
	}
	stage(stageFinal, final, func() []delivery { return rec.wire.finished(rec, run, final) })
	s.finish(rec, final, log)
}
