package grader

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// bucketName is the JetStream key-value bucket that holds the gradings:
// one key per rollout, shared by every grader replica on the same NATS.
const bucketName = "osmo_gradings"

// minBucketTTL is the shortest MaxAge JetStream accepts for a stream.
// Reads filter gradings by their own age, so a bucket that keeps a key a
// little longer than ResultTTL answers nothing more for it.
const minBucketTTL = 100 * time.Millisecond

// grading is one run of a grader over samples of one rollout: an outcome per
// sample, or one error for all of them.
type grading struct {
	RolloutID string    `json:"rollout_id"`
	Grader    string    `json:"grader"`
	GradedAt  time.Time `json:"graded_at"`
	Error     string    `json:"error,omitempty"`
	// Category classifies Error: timeout, validation_error or agent_error.
	Category outcome.Category `json:"category,omitempty"`
	Samples  []sampleResult   `json:"samples"`
}

// sampleResult is one sample's outcome; Reward is nil when it was removed
// or the grading failed.
type sampleResult struct {
	ID     string   `json:"id"`
	Reward *float64 `json:"reward,omitempty"`
	Remove bool     `json:"remove_sample,omitempty"`
	// Fingerprint is the sample's as graded: the outcome answers only a
	// sample with the same one (and, without one, nothing).
	Fingerprint string `json:"fingerprint,omitempty"`
}

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

// without returns g less the samples in ids (g itself when none is, nil
// when nothing is left). It copies, so answers taken from g keep theirs.
func (g *grading) without(ids map[string]bool) *grading {
	keep := slices.DeleteFunc(slices.Clone(g.Samples), func(r sampleResult) bool { return ids[r.ID] })
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

type answer struct {
	g     *grading
	r     sampleResult
	fresh bool // graded for this very request
}

// gradingList is one rollout's gradings, the value of its key.
type gradingList []*grading

func expired(g *grading, ttl time.Duration, now time.Time) bool {
	return now.Sub(g.GradedAt) >= ttl
}

// with returns gs plus g, which replaces what earlier gradings hold for its
// samples, so the list keeps one outcome per sample. Expired gradings are
// dropped, so a rollout's value does not grow while it is written to.
func (gs gradingList) with(g *grading, ttl time.Duration, now time.Time) gradingList {
	ids := make(map[string]bool, len(g.Samples))
	for _, r := range g.Samples {
		ids[r.ID] = true
	}
	out := make(gradingList, 0, len(gs)+1)
	for _, o := range gs {
		if expired(o, ttl, now) {
			continue
		}
		if o = o.without(ids); o != nil {
			out = append(out, o)
		}
	}
	return append(out, g)
}

// lookup finds the live outcomes of ids that answer their fingerprint in
// fps; missing lists the others in order, changed counts those of them a
// live grading holds with another fingerprint.
func (gs gradingList) lookup(ids []string, fps map[string]string, ttl time.Duration, now time.Time) (found map[string]answer, missing []string, changed int) {
	found = make(map[string]answer, len(ids))
	for _, id := range ids {
		hit, held := false, false
		for _, g := range gs {
			if expired(g, ttl, now) {
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

// store keeps each rollout's gradingList, as JSON, under natsstore.Key of
// its id in the bucket. The bucket's TTL drops a rollout ResultTTL after
// its last grading; reads skip older gradings of a rollout still kept.
type store struct {
	kv  jetstream.KeyValue
	ttl time.Duration
	log *slog.Logger
}

// openStore creates the bucket, or sets its TTL to ttl if it exists.
func openStore(ctx context.Context, st *natsstore.Store, ttl time.Duration, log *slog.Logger) (*store, error) {
	// Setup asks again while a cluster just formed cannot place the bucket.
	var kv jetstream.KeyValue
	if err := st.Setup(ctx, "gradings bucket", func(ctx context.Context) (err error) {
		kv, err = st.KeyValue(ctx, jetstream.KeyValueConfig{
			Bucket:      bucketName,
			Description: "osmo grader: the gradings of each rollout, so a resent sample is answered instead of graded again",
			TTL:         max(ttl, minBucketTTL),
		})
		return err
	}); err != nil {
		return nil, err
	}
	return &store{kv: kv, ttl: ttl, log: log}, nil
}

// get reads rollout rid's gradings and their revision (0: none). A value
// that does not decode is logged and read as none, to be replaced.
func (s *store) get(ctx context.Context, rid string) (gradingList, uint64, error) {
	e, err := s.kv.Get(ctx, natsstore.Key(rid))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("gradings of rollout %q: kv get: %w", rid, err)
	}
	var gs gradingList
	if err := json.Unmarshal(e.Value(), &gs); err != nil {
		s.log.ErrorContext(ctx, "stored gradings do not decode; their samples will be graded again", "rollout_id", rid, "revision", e.Revision(), "error", err)
		return nil, e.Revision(), nil
	}
	return gs, e.Revision(), nil
}

// add stores g as the latest grading of its samples, in a compare-and-set
// loop: when another replica wrote the rollout between the read and the
// write, g is laid over what it wrote, so neither grading is lost.
func (s *store) add(ctx context.Context, g *grading) error {
	key := natsstore.Key(g.RolloutID)
	// Most rollouts are graded once: create first, read only when it exists.
	var gs gradingList
	var rev uint64
	for {
		val, err := json.Marshal(gs.with(g, s.ttl, time.Now()))
		if err != nil {
			return fmt.Errorf("gradings of rollout %q: encode: %w", g.RolloutID, err)
		}
		if rev == 0 {
			_, err = s.kv.Create(ctx, key, val)
		} else {
			_, err = s.kv.Update(ctx, key, val, rev)
		}
		switch {
		case err == nil:
			return nil
		case errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyRevisionMismatch):
			if ctx.Err() != nil {
				return fmt.Errorf("gradings of rollout %q: %w", g.RolloutID, ctx.Err())
			}
		case rev == 0:
			return fmt.Errorf("gradings of rollout %q: kv create: %w", g.RolloutID, err)
		default:
			return fmt.Errorf("gradings of rollout %q: kv update: %w", g.RolloutID, err)
		}
		if gs, rev, err = s.get(ctx, g.RolloutID); err != nil {
			return err
		}
	}
}
