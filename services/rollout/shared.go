package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/outcome"
)

// The rollout state every replica shares lives in NATS JetStream:
//
//	osmo_rollouts  (KV)     one lifecycle per rollout id: its request, the
//	                        phase it reached, who runs it, the callbacks
//	                        each stage owes and which are done. Created if
//	                        absent at admission: one id, one run. A finished
//	                        one is kept for the record TTL (a per-key TTL)
//	                        to answer duplicate starts and status queries.
//	osmo_work      (stream) the queue: one message per accepted rollout,
//	                        taken by replicas up to their free slots and
//	                        held (in-progress acks) until its callbacks are
//	                        delivered or in the outbox. A dead replica's is
//	                        taken by another after --lost-after, which
//	                        concludes the rollout from its lifecycle.
//	osmo_outbox    (stream) callbacks whose first attempt failed: any
//	                        replica posts them, redelivered with a delay
//	                        until the delivery deadline.
//	osmo_records   (KV)     finished rollouts as GetRollout renders them,
//	                        for the record TTL and up to --record-max-bytes;
//	                        its revisions are WatchRollouts' sequence.
//
// A private state keeps the bodies (localBodies) and the queue
// (privateQueue) in process instead. Core NATS carries a cancel, and a
// GetRollout of a running rollout, to the replica that holds it.
const (
	bucketRollouts  = "osmo_rollouts"
	bucketRecords   = "osmo_records"
	streamWork      = "osmo_work"
	streamOutbox    = "osmo_outbox"
	subjectWork     = "osmo.work."
	subjectQueued   = subjectWork + "q."
	subjectControl  = subjectWork + "c."
	subjectOutbox   = "osmo.outbox."
	subjectCancel   = "osmo.rollout.cancel"
	subjectGet      = "osmo.rollout.get."
	consumerWork    = "rollout-work"
	consumerControl = "rollout-control"
	consumerOutbox  = "rollout-outbox"
)

// Phases of a lifecycle, in order.
const (
	// phaseAdmitting: a G1 init whose tools are being computed.
	phaseAdmitting = "admitting"
	phaseQueued    = "queued"
	phaseRunning   = "running"
	// phaseRan: the run ended and its callbacks are owed; grading, if any,
	// goes on.
	phaseRan = "ran"
	// phaseFinal: the outcome is final and its callbacks are owed.
	phaseFinal    = "final"
	phaseFinished = "finished"
)

// Stages whose callbacks a lifecycle owes, in order.
const (
	stageRan   = "ran"
	stageFinal = "final"
)

var stageNames = [2]string{stageRan, stageFinal}

// stage is lc's stage of that name (nil when not owed).
func (lc *lifecycle) stage(name string) *owedStage {
	if name == stageRan {
		return lc.Ran
	}
	return lc.Final
}

// lifecycle is a rollout as every replica sees it, JSON in osmo_rollouts.
type lifecycle struct {
	ID string `json:"id"`
	// Key is the idempotency key it was admitted under (G1's
	// idempotency_key, else the id).
	Key      string    `json:"key"`
	Wire     string    `json:"wire"`
	Workflow string    `json:"workflow"`
	Created  time.Time `json:"created"`
	// Request is the wire's request (proto); Response is G1's init answer.
	Request  []byte `json:"request,omitempty"`
	Response []byte `json:"response,omitempty"`
	// Trace carries the admitting request's trace context, so the rollout's
	// span joins its trace wherever the rollout runs.
	Trace map[string]string `json:"trace,omitempty"`

	Phase string          `json:"phase"`
	State rolloutv1.State `json:"state"`
	Owner string          `json:"owner,omitempty"`
	// Held is the stream sequence of the work message that holds the
	// rollout (from the queue, or the control queue for one cancelled
	// while queued): another message for it is stale.
	Held      string    `json:"held,omitempty"`
	Started   time.Time `json:"started,omitzero"`
	Cancelled bool      `json:"cancelled,omitempty"`
	// Ran and Final are the stages' callbacks, once owed.
	Ran   *owedStage `json:"ran,omitempty"`
	Final *owedStage `json:"final,omitempty"`
	// Outcome and Reward are the rollout's, once final.
	Outcome       *savedOutcome `json:"outcome,omitempty"`
	Reward        *float64      `json:"reward,omitempty"`
	Finished      time.Time     `json:"finished,omitzero"`
	CallbackError string        `json:"callback_error,omitempty"`

	// admitted is Request as decoded at admission, never stored: the one
	// replica of an embedded server runs what it admits and need not decode
	// it again.
	admitted proto.Message
}

// owedStage is a stage's callbacks, its outcome, and which callbacks are
// done with (delivered, refused for good, or given up on).
type owedStage struct {
	Outcome   savedOutcome    `json:"outcome"`
	Callbacks []savedCallback `json:"callbacks"`
	Done      []bool          `json:"done"`
	// Sending: the delivery of this stage began (for the final stage, only
	// once the first stage's callbacks are done, so they arrive in order).
	// Whoever sets it delivers the stage.
	Sending bool `json:"sending,omitempty"`
}

func (st *owedStage) done() bool {
	if st == nil {
		return false
	}
	for _, d := range st.Done {
		if !d {
			return false
		}
	}
	return true
}

// clone is a copy of lc that a change may alter without altering lc: what
// changes alter in place (a stage's Done marks, Sending) is copied, what
// they only replace (the request, the outcome, the reward) is shared.
func (lc *lifecycle) clone() *lifecycle {
	cp := *lc
	cp.Ran, cp.Final = lc.Ran.clone(), lc.Final.clone()
	return &cp
}

func (st *owedStage) clone() *owedStage {
	if st == nil {
		return nil
	}
	cp := *st
	cp.Callbacks, cp.Done = slices.Clone(st.Callbacks), slices.Clone(st.Done)
	return &cp
}

type savedOutcome struct {
	State    rolloutv1.State  `json:"state"`
	Category outcome.Category `json:"category,omitempty"`
	Message  string           `json:"message,omitempty"`
}

func saveOutcome(o outcome.Outcome) savedOutcome {
	return savedOutcome{State: o.State, Category: o.Category, Message: o.Message}
}

func (o savedOutcome) outcome() outcome.Outcome {
	return outcome.Outcome{State: o.State, Category: o.Category, Message: o.Message}
}

// savedCallback is a delivery as the lifecycle keeps it; its policy is the
// wire's (policyOf).
type savedCallback struct {
	Event  string `json:"event"`
	Route  string `json:"route"`
	URL    string `json:"url"`
	Bearer string `json:"bearer,omitempty"`
	Status string `json:"status"`
	// Payload and Bearer are dropped once the callback is done with.
	Payload json.RawMessage `json:"payload,omitempty"`
}

func (c savedCallback) delivery(p callbackPolicy) delivery {
	return delivery{event: c.Event, route: c.Route, url: c.URL, bearer: c.Bearer, status: c.Status, payload: c.Payload, policy: p}
}

// shared is the service's handle on the JetStream state.
type shared struct {
	store    *natsstore.Store
	js       jetstream.JetStream
	rollouts jetstream.KeyValue
	records  jetstream.KeyValue
	work     jetstream.Consumer
	control  jetstream.Consumer
	queue    jetstream.Stream
	outboxes jetstream.Stream
	outbox   jetstream.Consumer
	// keep is how long a finished lifecycle is kept (the record TTL).
	keep time.Duration
	// wrote counts each write and its bytes (osmo_state_writes_total).
	wrote func(bytes int)
	// known holds the last lifecycles read or written here, so that a
	// stage change of a rollout this replica runs writes without a read.
	known known
	// bodies and local are a private state's bodies and queue (nil
	// otherwise).
	bodies *localBodies
	local  *privateQueue
	// depth is the queue's depth as admission last read it.
	depth queueDepth
}

// queueDepth is the queue's depth as read at read, and the starts this
// replica admitted since.
type queueDepth struct {
	mu       sync.Mutex
	n        int64
	admitted int64
	read     time.Time
}

// depthFresh is how long a read of the queue's depth stands in for the
// next ones while the queue is far from full.
const depthFresh = 100 * time.Millisecond

// known is a bounded cache of lifecycles as stored, with their revision.
// A stale one costs a failed compare-and-set, after which update reads.
type known struct {
	mu sync.Mutex
	m  map[string]knownLifecycle
}

type knownLifecycle struct {
	lc  *lifecycle // never changed: update changes a clone
	rev uint64
}

// maxKnown bounds the cache: more than a replica runs at once.
const maxKnown = 1 << 14

func (k *known) get(id string) (knownLifecycle, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e, ok := k.m[id]
	return e, ok
}

func (k *known) put(id string, lc *lifecycle, rev uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[string]knownLifecycle{}
	}
	if _, ok := k.m[id]; !ok && len(k.m) >= maxKnown {
		// Full: one goes, whichever the map yields first.
		for old := range k.m {
			delete(k.m, old)
			break
		}
	}
	k.m[id] = knownLifecycle{lc: lc, rev: rev}
}

func (k *known) drop(id string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.m, id)
}

// maxAckPending bounds the rollouts held by all replicas together: far
// above what any deployment runs at once.
const maxAckPending = 1 << 20

// openShared creates (or updates) the buckets, streams and consumers.
// New retries the whole while the cluster settles, so every step is safe
// to repeat.
func openShared(ctx context.Context, st *natsstore.Store, cfg Config) (*shared, error) {
	sh := &shared{store: st, js: st.JS, keep: cfg.RecordTTL, wrote: func(int) {}}
	if st.Private() {
		sh.bodies = &localBodies{}
		sh.local = newPrivateQueue()
	}
	// Each bucket, stream and consumer is looked up first and changed only
	// when missing or set otherwise: a lookup is answered by the leader at
	// once, a change waits for the cluster's meta layer.
	var err error
	// LimitMarkerTTL allows per-key TTLs. Lifecycles are read from the
	// leader only: a direct get, which any replica answers, can return an
	// older revision, on which a replica would drop work. A stream of one
	// copy has only its leader, whose direct get is as fresh and cheaper.
	direct := st.Replicas() == 1
	if sh.rollouts, err = keyValue(ctx, st, jetstream.KeyValueConfig{
		Bucket: bucketRollouts, Description: "osmo: rollout lifecycles", History: 1, LimitMarkerTTL: time.Minute,
		MaxValueSize: natsstore.DefaultMaxPayload,
	}, func(c *jetstream.StreamConfig) bool {
		ok := c.AllowDirect == direct && !c.MirrorDirect
		c.AllowDirect, c.MirrorDirect = direct, false
		return ok
	}); err != nil {
		return nil, err
	}
	// A bucket refuses writes once full; finished records make room for
	// the newest by dropping the oldest instead.
	if sh.records, err = keyValue(ctx, st, jetstream.KeyValueConfig{
		Bucket: bucketRecords, Description: "osmo: finished rollouts", History: 1, TTL: cfg.RecordTTL,
		MaxBytes: cfg.MaxRecordBytes, MaxValueSize: natsstore.DefaultMaxPayload,
	}, func(c *jetstream.StreamConfig) bool {
		ok := c.Discard == jetstream.DiscardOld && c.MaxAge == cfg.RecordTTL && c.MaxBytes == cfg.MaxRecordBytes
		c.Discard, c.MaxAge, c.MaxBytes = jetstream.DiscardOld, cfg.RecordTTL, cfg.MaxRecordBytes
		return ok
	}); err != nil {
		return nil, err
	}
	// A callback handed over twice within the dedup window is kept once:
	// the window spans its whole delivery.
	dedup := max(10*time.Minute, cfg.Callbacks.Deadline+5*time.Minute)
	for i, s := range []jetstream.StreamConfig{
		{Name: streamWork, Description: "osmo: accepted rollouts waiting for, or held by, a replica", Subjects: []string{subjectWork + ">"},
			Retention: jetstream.WorkQueuePolicy, Duplicates: 10 * time.Minute},
		{Name: streamOutbox, Description: "osmo: callbacks being retried", Subjects: []string{subjectOutbox + ">"},
			Retention: jetstream.WorkQueuePolicy, Duplicates: dedup},
	} {
		str, err := st.JS.Stream(ctx, s.Name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			str, err = st.Stream(ctx, s)
		}
		if err != nil {
			return nil, fmt.Errorf("rollout: stream %s: %w", s.Name, err)
		}
		if i == 0 {
			sh.queue = str
		} else {
			sh.outboxes = str
		}
	}
	cons := func(stream, name, filter string) (jetstream.Consumer, error) {
		if st.Embedded() {
			// Nobody else shares an embedded store: what a previous run of
			// this process held is taken back at once, not after LostAfter.
			if err := st.JS.DeleteConsumer(ctx, stream, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				return nil, fmt.Errorf("rollout: consumer %s: %w", name, err)
			}
		} else if c, err := st.JS.Consumer(ctx, stream, name); err == nil && c.CachedInfo().Config.AckWait == cfg.LostAfter {
			return c, nil
		}
		c, err := st.JS.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
			Durable: name, FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy, AckWait: cfg.LostAfter,
			MaxDeliver: -1, MaxAckPending: maxAckPending, Replicas: st.Replicas(),
		})
		if err != nil {
			return nil, fmt.Errorf("rollout: consumer %s: %w", name, err)
		}
		return c, nil
	}
	if sh.work, err = cons(streamWork, consumerWork, subjectQueued+">"); err != nil {
		return nil, err
	}
	if sh.control, err = cons(streamWork, consumerControl, subjectControl+">"); err != nil {
		return nil, err
	}
	if sh.outbox, err = cons(streamOutbox, consumerOutbox, ""); err != nil {
		return nil, err
	}
	return sh, nil
}

// keyValue looks a bucket up, or creates it; adjust, when given, says
// whether the bucket's stream is set as wanted (and sets it so): if not,
// the stream is updated.
func keyValue(ctx context.Context, st *natsstore.Store, cfg jetstream.KeyValueConfig, adjust func(*jetstream.StreamConfig) bool) (jetstream.KeyValue, error) {
	kv, err := st.JS.KeyValue(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = st.KeyValue(ctx, cfg)
	}
	if err != nil {
		return nil, fmt.Errorf("rollout: bucket %s: %w", cfg.Bucket, err)
	}
	if adjust == nil {
		return kv, nil
	}
	str, err := st.JS.Stream(ctx, "KV_"+cfg.Bucket)
	if err != nil {
		return nil, fmt.Errorf("rollout: bucket %s: %w", cfg.Bucket, err)
	}
	c := str.CachedInfo().Config
	if adjust(&c) {
		return kv, nil
	}
	if _, err := st.JS.UpdateStream(ctx, c); err != nil {
		return nil, fmt.Errorf("rollout: bucket %s: %w", cfg.Bucket, err)
	}
	// The handle reads the stream's settings when it is made.
	return st.JS.KeyValue(ctx, cfg.Bucket)
}

// errGone: the rollout has no lifecycle (never admitted, or expired).
var errGone = errors.New("no such rollout")

// get reads id's lifecycle and its revision.
func (sh *shared) get(ctx context.Context, id string) (*lifecycle, uint64, error) {
	e, err := sh.rollouts.Get(ctx, natsstore.Key(id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		// Bodies held for id stay: they may be an admission's, kept before
		// its create.
		return nil, 0, errGone
	}
	if err != nil {
		return nil, 0, err
	}
	lc := &lifecycle{}
	if err := json.Unmarshal(e.Value(), lc); err != nil {
		return nil, 0, fmt.Errorf("rollout %q: lifecycle: %w", id, err)
	}
	sh.bodies.fill(lc)
	if lc.Phase != phaseFinished {
		sh.known.put(id, lc.clone(), e.Revision())
	}
	return lc, e.Revision(), nil
}

// queuedLifecycle is id's lifecycle for a replica that took it from the
// queue. On a first delivery the known lifecycle, if queued, is taken
// without a read: the only change a queued rollout sees is a cancel, which
// fails the compare-and-set of the write that starts it. A redelivery may
// be a lost replica's rollout, long past queued: it is read.
func (sh *shared) queuedLifecycle(ctx context.Context, id string, firstDelivery bool) (*lifecycle, error) {
	if k, ok := sh.known.get(id); ok && firstDelivery && k.lc.Phase == phaseQueued {
		return k.lc.clone(), nil
	}
	lc, _, err := sh.get(ctx, id)
	return lc, err
}

// create stores lc unless its id has a lifecycle already: then it returns
// that one (dup).
func (sh *shared) create(ctx context.Context, lc *lifecycle) (existing *lifecycle, rev uint64, err error) {
	for {
		// Held before the write, so a reader finds them; unless the id
		// holds another admission's (a racing duplicate): then this one is
		// stored whole.
		kept := sh.bodies.keepNew(lc)
		b, err := lc.encode(sh.bodies == nil || !kept)
		if err != nil {
			return nil, 0, err
		}
		rev, err = sh.rollouts.Create(ctx, natsstore.Key(lc.ID), b)
		sh.wrote(len(b))
		if err == nil {
			sh.known.put(lc.ID, lc.clone(), rev)
			return nil, rev, nil
		}
		// A create that failed otherwise may have been written: what was
		// kept stays.
		if !errors.Is(err, jetstream.ErrKeyExists) {
			return nil, 0, err
		}
		existing, rev, err = sh.get(ctx, lc.ID)
		if errors.Is(err, errGone) {
			continue // deleted (a failed init, an expiry) in between
		}
		if err == nil && kept && !existing.Created.Equal(lc.Created) {
			// The id is another admission's: what this one kept goes.
			sh.bodies.forget(lc)
		}
		return existing, rev, err
	}
}

// errUnchanged stops update without a write.
var errUnchanged = errors.New("unchanged")

// update applies change to id's lifecycle and stores it under the revision
// it read, reading again and reapplying when another write came between; it
// returns what it stored, which the caller must not change (known holds
// it). change returning errUnchanged stops without a write (update returns
// the lifecycle read and errUnchanged).
//
// The known lifecycle is changed first, without a read; when that fails
// the lifecycle is read and changed afresh, so change may run twice and
// must not keep what an earlier run decided.
func (sh *shared) update(ctx context.Context, id string, change func(lc *lifecycle) error) (*lifecycle, error) {
	if k, ok := sh.known.get(id); ok {
		if lc := k.lc.clone(); change(lc) == nil {
			err := sh.put(ctx, lc, k.rev)
			if err == nil {
				return lc, nil
			}
			if !isWrongSequence(err) {
				return nil, err
			}
		}
		sh.known.drop(id)
	}
	for {
		lc, rev, err := sh.get(ctx, id)
		if err != nil {
			return nil, err
		}
		if err := change(lc); err != nil {
			return lc, err
		}
		err = sh.put(ctx, lc, rev)
		if err == nil {
			return lc, nil
		}
		if !isWrongSequence(err) {
			return nil, err
		}
	}
}

// put stores lc if its revision is still rev.
func (sh *shared) put(ctx context.Context, lc *lifecycle, rev uint64) error {
	sh.bodies.keep(lc) // before the write, so a reader finds them
	b, err := lc.encode(sh.bodies == nil)
	if err != nil {
		return err
	}
	if lc.Phase != phaseFinished {
		next, err := sh.rollouts.Update(ctx, natsstore.Key(lc.ID), b, rev)
		sh.wrote(len(b))
		if err != nil {
			sh.known.drop(lc.ID)
			return err
		}
		sh.known.put(lc.ID, lc, next)
		return nil
	}
	sh.known.drop(lc.ID)
	// The KV API sets a TTL only on create: a finished lifecycle is
	// published to its key's subject with a per-message TTL.
	msg := &nats.Msg{Subject: "$KV." + bucketRollouts + "." + natsstore.Key(lc.ID), Data: b}
	_, err = sh.js.PublishMsg(ctx, msg, jetstream.WithExpectLastSequencePerSubject(rev),
		jetstream.WithMsgTTL(max(sh.keep, time.Second)))
	sh.wrote(len(b))
	if err == nil {
		sh.bodies.forget(lc)
	}
	return err
}

func isWrongSequence(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		// Replicated streams report a compare-and-set conflict as 10164.
		return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
	}
	return errors.Is(err, jetstream.ErrKeyExists)
}

// remove deletes id's lifecycle (an init that failed before it was
// queued), so a retry starts afresh.
func (sh *shared) remove(ctx context.Context, id string) error {
	sh.bodies.drop(id)
	return sh.rollouts.Purge(ctx, natsstore.Key(id))
}

// enqueue puts an admitted rollout on the work queue, sending a publish
// whose answer was lost again (the stream drops duplicates) for up to 10s;
// in a private state, in the place admitQueued reserved when reserved.
func (sh *shared) enqueue(ctx context.Context, lc *lifecycle, reserved bool) error {
	if sh.local != nil {
		sh.local.push(lc.ID, reserved)
		return nil
	}
	return resend(ctx, 10*time.Second, 250*time.Millisecond, func(ctx context.Context) error {
		return sh.publishWork(ctx, subjectQueued, lc)
	})
}

// resend calls publish, each try bounded to 5s, until it succeeds, ctx
// ends or within has passed, pause apart.
func resend(ctx context.Context, within, pause time.Duration, publish func(context.Context) error) error {
	giveUp := time.Now().Add(within)
	for {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := publish(pctx)
		cancel()
		if err == nil || ctx.Err() != nil || time.Now().After(giveUp) {
			return err
		}
		sleepCtx(ctx, pause)
	}
}

// conclude asks any replica to conclude a rollout cancelled while queued,
// without waiting for a slot: it has nothing to run.
func (sh *shared) conclude(ctx context.Context, lc *lifecycle) error {
	if err := sh.publishWork(ctx, subjectControl, lc); err != nil {
		return err
	}
	// Its place in the queue is free at once.
	if sh.local != nil {
		sh.local.remove(lc.ID)
		return nil
	}
	return sh.queue.Purge(ctx, jetstream.WithPurgeSubject(subjectQueued+natsstore.Key(lc.ID)))
}

func (sh *shared) publishWork(ctx context.Context, prefix string, lc *lifecycle) error {
	msg := nats.NewMsg(prefix + natsstore.Key(lc.ID))
	msg.Header.Set(jetstream.MsgIDHeader, prefix+lc.ID+"@"+strconv.FormatInt(lc.Created.UnixNano(), 10))
	_, err := sh.js.PublishMsg(ctx, msg)
	sh.wrote(0)
	return err
}

// queued is how many rollouts wait in the queue, all replicas together.
func (sh *shared) queued(ctx context.Context) (int64, error) {
	if sh.local != nil {
		return sh.local.depth(), nil
	}
	info, err := sh.work.Info(ctx)
	if err != nil {
		return 0, err
	}
	return int64(info.NumPending), nil
}

// admitQueued reports whether the queue has room for one more start under
// bound, and the depth it went by. Reading the depth (a consumer's info) is
// costly: a read less than depthFresh old, plus the starts admitted here
// since, stands in for it while under half the bound; that estimate is
// only ever high. A private state's queue is counted exactly, and room
// granted there is a place reserved (see privateQueue.reserve).
func (sh *shared) admitQueued(ctx context.Context, bound int64) (room bool, n int64, err error) {
	if sh.local != nil {
		room, n = sh.local.reserve(bound)
		return room, n, nil
	}
	d := &sh.depth
	d.mu.Lock()
	defer d.mu.Unlock()
	if time.Since(d.read) < depthFresh && d.n+d.admitted+1 < bound/2 {
		d.admitted++
		return true, d.n + d.admitted - 1, nil
	}
	if n, err = sh.queued(ctx); err != nil {
		return false, 0, err
	}
	d.n, d.admitted, d.read = n, 0, time.Now()
	if n >= bound {
		return false, n, nil
	}
	d.admitted++
	return true, n, nil
}

// outboxMsg names one owed callback in the outbox; the callback itself is
// in the rollout's lifecycle.
type outboxMsg struct {
	ID    string `json:"id"`
	Stage string `json:"stage"`
	Index int    `json:"index"`
	// Attempts made before the outbox, and when it fell due (the delivery
	// deadline counts from then).
	Attempts int       `json:"attempts"`
	Due      time.Time `json:"due"`
	// again: a hand-over replacing one the outbox lost.
	again bool
}

func outboxSubject(id, stage string, i int) string {
	return subjectOutbox + natsstore.Key(id) + "." + stage + "." + strconv.Itoa(i)
}

// inOutbox reports whether the outbox holds a stage's callback i.
func (sh *shared) inOutbox(ctx context.Context, id, stage string, i int) (bool, error) {
	_, err := sh.outboxes.GetLastMsgForSubject(ctx, outboxSubject(id, stage, i))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return false, nil
	}
	return err == nil, err
}

// handOver puts a callback into the outbox, sending a publish whose answer
// was lost again (the dedup window drops the second) for up to 15s.
func (sh *shared) handOver(ctx context.Context, created time.Time, m outboxMsg) error {
	return resend(ctx, 15*time.Second, 500*time.Millisecond, func(ctx context.Context) error {
		return sh.handOverOnce(ctx, created, m)
	})
}

func (sh *shared) handOverOnce(ctx context.Context, created time.Time, m outboxMsg) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	msg := nats.NewMsg(outboxSubject(m.ID, m.Stage, m.Index))
	msg.Data = b
	id := fmt.Sprintf("%s@%d/%s/%d", m.ID, created.UnixNano(), m.Stage, m.Index)
	if m.again {
		// That hand-over's message is gone (see repair).
		id += "/again@" + strconv.FormatInt(time.Now().UnixNano(), 10)
	}
	msg.Header.Set(jetstream.MsgIDHeader, id)
	_, err = sh.js.PublishMsg(ctx, msg)
	sh.wrote(len(b))
	return err
}

// idOfSubject is the rollout id in a work or outbox subject: the token
// after prefix.
func idOfSubject(subject, prefix string) (string, error) {
	rest := strings.TrimPrefix(subject, prefix)
	key, _, _ := strings.Cut(rest, ".")
	return natsstore.ID(key)
}
