package rollout

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/rows"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/internal/telemetry/osmoattr"
)

// Training rows are derived from a finished rollout's recorded calls
// wherever they are asked for, never stored: GetRolloutRows builds them
// from the record GetRollout reads, StreamRows from the records bucket's
// stream as WatchRollouts reads it.

// rowsRecord is what rows need of a finished rollout's record (the stored
// rolloutRecord, or a live one), decoded without the conversation.
type rowsRecord struct {
	RolloutID string          `json:"rollout_id"`
	State     rolloutv1.State `json:"state"`
	Samples   []rowsSample    `json:"samples"`
	Stale     bool            `json:"stale"`
}

type rowsSample struct {
	ID           string          `json:"id"`
	Reward       *float64        `json:"reward"`
	AgentReward  *float64        `json:"agent_reward"`
	RemoveSample bool            `json:"remove_sample"`
	LLMCalls     []*osmo.LLMCall `json:"llm_calls"`
}

// rowsOf reads a rollout's samples for rows.
func rowsOf(rolloutID string, state rolloutv1.State, samples []*sample.Sample) *rowsRecord {
	out := &rowsRecord{RolloutID: rolloutID, State: state, Samples: make([]rowsSample, len(samples))}
	for i, sm := range samples {
		out.Samples[i] = rowsSample{ID: sm.ID, Reward: sm.Reward, AgentReward: sm.AgentReward, RemoveSample: sm.RemoveSample, LLMCalls: sm.LLMCalls}
	}
	return out
}

// rolloutRows is the API's RolloutRows under its JSON names.
type rolloutRows struct {
	Rows    []rows.Row   `json:"rows"`
	Samples []sampleRows `json:"samples"`
}

// sampleRows is the API's SampleRows under its JSON names.
type sampleRows struct {
	SampleID string         `json:"sample_id"`
	Rows     int            `json:"rows"`
	Problems []rows.Problem `json:"problems,omitempty"`
}

// build builds every sample's rows, in sample order then row order. A
// row's reward is its sample's as the callbacks send it: the grader's,
// else the one the workflow proposed, when the rollout succeeded and the
// grader kept the sample.
func (r *rowsRecord) build(o rows.Options) rolloutRows {
	out := rolloutRows{Samples: make([]sampleRows, 0, len(r.Samples))}
	for _, sm := range r.Samples {
		var reward *float64
		if r.State == rolloutv1.State_STATE_SUCCEEDED && !sm.RemoveSample {
			reward = cmp.Or(sm.Reward, sm.AgentReward)
		}
		res := rows.Build(rows.Sample{RolloutID: r.RolloutID, SampleID: sm.ID, Reward: reward, Calls: sm.LLMCalls}, o)
		for i := range res.Rows {
			res.Rows[i].Stale = r.Stale
		}
		out.Rows = append(out.Rows, res.Rows...)
		out.Samples = append(out.Samples, sampleRows{SampleID: sm.ID, Rows: len(res.Rows), Problems: res.Problems})
	}
	return out
}

// finishedState reports whether a rollout in state st has its final
// samples (and rewards).
func finishedState(st rolloutv1.State) bool {
	switch st {
	case rolloutv1.State_STATE_SUCCEEDED, rolloutv1.State_STATE_FAILED, rolloutv1.State_STATE_CANCELLED:
		return true
	}
	return false
}

func notFinished(id string, st rolloutv1.State) error {
	return status.Errorf(codes.FailedPrecondition, "rollout %q has not finished (state %s): its rows are built once it has", id, st)
}

// GetRolloutRows returns the training rows of a finished rollout, built
// from its record: this replica's live one, the stored one, or the live
// one of the replica that ran it while it stores it.
func (s *Service) GetRolloutRows(ctx context.Context, req *rolloutv1.GetRolloutRowsRequest) (*rolloutv1.RolloutRows, error) {
	id := req.GetRolloutId()
	if id == "" {
		return nil, fielderr.New("rollout_id", "required")
	}
	mode, err := rows.ParseMerge(req.GetMerge())
	if err != nil {
		return nil, err
	}
	rec, err := s.finishedRows(ctx, id)
	if err != nil {
		return nil, err
	}
	out := &rolloutv1.RolloutRows{}
	if err := sample.ToProto(rec.build(rows.Options{Merge: mode, VocabSize: s.cfg.PolicyVocabSize}), out); err != nil {
		return nil, status.Errorf(codes.Internal, "render the rows of rollout %q: %v", id, err)
	}
	return out, nil
}

// finishedRows reads what rows need of a finished rollout, the way
// GetRollout finds its record.
func (s *Service) finishedRows(ctx context.Context, id string) (*rowsRecord, error) {
	if rec := s.store.get(id); rec != nil {
		rec.mu.Lock()
		st := rec.state
		rec.mu.Unlock()
		if !finishedState(st) {
			return nil, notFinished(id, st)
		}
		out := rowsOf(id, st, rec.snapshot())
		rec.mu.Lock()
		out.Stale = rec.stale
		rec.mu.Unlock()
		return out, nil
	}
	lc, _, err := s.sh.get(ctx, id)
	switch {
	case errors.Is(err, errGone):
		return nil, status.Errorf(codes.NotFound, "rollout %q not found", id)
	case err != nil:
		return nil, unavailable(err)
	}
	if lc.Outcome == nil || !finishedState(lc.State) {
		return nil, notFinished(id, lc.State)
	}
	e, err := s.sh.records.Get(ctx, natsstore.Key(id))
	switch {
	case err == nil:
		return decodeRows(e.Value())
	case !errors.Is(err, jetstream.ErrKeyNotFound):
		return nil, unavailable(err)
	}
	// The replica that ran it answers until it stored the record.
	storing := lc.Phase != phaseFinished || time.Since(lc.Finished) < recordSettle
	if storing && lc.Owner != "" && lc.Owner != s.replica {
		if b, err := s.askOwnerJSON(ctx, lc.Owner, id); err == nil {
			rec, err := decodeRows(b)
			if err == nil && finishedState(rec.State) {
				return rec, nil
			}
		}
	}
	if storing {
		return nil, status.Errorf(codes.Unavailable, "rollout %q finished and its record is being stored; ask again", id)
	}
	return nil, status.Errorf(codes.NotFound, "rollout %q finished but its record is no longer held (see the record TTL and size bound)", id)
}

func decodeRows(b []byte) (*rowsRecord, error) {
	var rec rowsRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, status.Errorf(codes.Internal, "read a rollout record: %v", err)
	}
	return &rec, nil
}

// A StreamRows cursor is "<seq>-<row>-<state>": the records stream's
// sequence of the rollout's record, the row's index among that rollout's
// rows, and the state it is from: the stream's creation time (nanoseconds,
// base 36). A state wiped and made anew (an in-memory one restarted)
// numbers its records from 1 again, and a cursor from the old one must not
// skip the new one's rows. "now" and "" are the two starts that are not
// cursors.
const afterNow = "now"

type cursor struct {
	seq   uint64
	row   int
	state string
}

func (c cursor) String() string {
	return strconv.FormatUint(c.seq, 10) + "-" + strconv.Itoa(c.row) + "-" + c.state
}

// stateOf names the state a records stream is.
func stateOf(info *jetstream.StreamInfo) string {
	return strconv.FormatInt(info.Created.UnixNano(), 36)
}

func parseCursor(after string) (cursor, error) {
	parts := strings.Split(after, "-")
	var c cursor
	ok := len(parts) == 3 && parts[2] != ""
	if ok {
		var err, rowErr error
		var row uint64
		c.seq, err = strconv.ParseUint(parts[0], 10, 64)
		row, rowErr = strconv.ParseUint(parts[1], 10, 31)
		c.row, c.state = int(row), parts[2]
		ok = err == nil && rowErr == nil && c.seq > 0
	}
	if !ok {
		return cursor{}, fielderr.New("after", `must be a row's cursor ("<sequence>-<row>-<state>"), "now" or empty, got %q`, after)
	}
	return c, nil
}

// StreamRows streams the rows of finished rollouts in the order their
// records were stored, read from the shared state, so that any replica
// resumes a client where another left it: after a row's cursor come the
// rows after it still held (all of them when the cursor is older than what
// is held), then those of rollouts finishing from now on.
func (s *Service) StreamRows(req *rolloutv1.StreamRowsRequest, stream grpc.ServerStreamingServer[rolloutv1.Row]) error {
	mode, err := rows.ParseMerge(req.GetMerge())
	if err != nil {
		return err
	}
	ctx := stream.Context()
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{"$KV." + bucketRecords + ".>"}, DeliverPolicy: jetstream.DeliverAllPolicy}
	var after cursor
	a := req.GetAfter()
	switch a {
	case "":
	case afterNow:
		cfg.DeliverPolicy = jetstream.DeliverNewPolicy
	default:
		if after, err = parseCursor(a); err != nil {
			return err
		}
	}
	st, err := s.sh.js.Stream(ctx, "KV_"+bucketRecords)
	if err != nil {
		return unavailable(err)
	}
	info := st.CachedInfo()
	state := stateOf(info)
	switch {
	case after.seq == 0:
	case after.state != state:
		// From a state that is gone: every row held came after it.
		after = cursor{}
	case after.seq > info.State.LastSeq:
		return fielderr.New("after", "cursor %q is past the last record (%d)", a, info.State.LastSeq)
	default:
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, after.seq
	}
	cons, err := s.sh.js.OrderedConsumer(ctx, "KV_"+bucketRecords, cfg)
	if err != nil {
		return unavailable(err)
	}
	it, err := cons.Messages()
	if err != nil {
		return unavailable(err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	stopOnShutdown := context.AfterFunc(s.streamsCtx, it.Stop)
	defer stopOnShutdown()
	// The request is good: headers now, so a client (the REST gateway
	// among them) knows before the first row comes.
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	for {
		msg, err := it.Next()
		if err != nil {
			switch {
			case ctx.Err() != nil:
				return nil
			case s.streamsCtx.Err() != nil:
				return status.Error(codes.Unavailable, "this replica is shutting down: resume after the last row's cursor on another")
			}
			return unavailable(err)
		}
		if op := msg.Headers().Get("KV-Operation"); op != "" {
			continue // a deletion or purge marker
		}
		meta, err := msg.Metadata()
		if err != nil {
			continue
		}
		rec, err := decodeRows(msg.Data())
		if err != nil {
			s.log.WarnContext(ctx, "rows stream: a record could not be read; its rows are skipped", "sequence", meta.Sequence.Stream, "error", err)
			continue
		}
		seq := meta.Sequence.Stream
		first := 0
		if seq == after.seq {
			first = after.row + 1
		}
		built := rec.build(rows.Options{Merge: mode, VocabSize: s.cfg.PolicyVocabSize})
		for i := first; i < len(built.Rows); i++ {
			built.Rows[i].Cursor = cursor{seq: seq, row: i, state: state}.String()
			out := &rolloutv1.Row{}
			if err := sample.ToProto(&built.Rows[i], out); err != nil {
				return status.Errorf(codes.Internal, "render a row of rollout %q: %v", rec.RolloutID, err)
			}
			if err := stream.Send(out); err != nil {
				return err
			}
		}
	}
}

// askOwnerJSON asks the replica holding a rollout for its live record, as
// it stores it.
func (s *Service) askOwnerJSON(ctx context.Context, owner, id string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	msg, err := s.sh.store.NC.RequestWithContext(ctx, subjectGet+natsstore.Key(owner), []byte(id))
	if err != nil {
		return nil, err
	}
	if len(msg.Data) == 0 {
		return nil, errGone
	}
	return msg.Data, nil
}

// countRows builds a finished rollout's rows once, exact, for the rows
// metrics and the drift events of its span; with Config.Rows off, nothing.
func (s *Service) countRows(rec *record) {
	if !s.cfg.Rows {
		return
	}
	samples := rec.snapshot()
	span := rec.rolloutSpan()
	for _, sm := range samples {
		if len(sm.LLMCalls) == 0 {
			continue
		}
		res := rows.Build(rows.Sample{RolloutID: rec.id, SampleID: sm.ID, Calls: sm.LLMCalls}, rows.Options{CountOnly: true, VocabSize: s.cfg.PolicyVocabSize})
		if len(res.Rows) == 0 {
			s.metrics.noTokens.Inc()
		}
		for _, r := range res.Rows {
			s.metrics.rows.WithLabelValues(r.Merge).Inc()
			for _, d := range r.Drift {
				s.metrics.rowDrift.WithLabelValues(d.Class).Inc()
				if span.IsRecording() {
					span.AddEvent("row_drift", trace.WithAttributes(osmoattr.SampleID.String(sm.ID),
						osmoattr.DriftCall.Int(d.Call), osmoattr.DriftPosition.Int(d.Position), osmoattr.DriftClass.String(d.Class)))
				}
			}
		}
	}
}
