package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// The policy state every replica shares, in the osmo_policy bucket:
//
//	state          the pause switch (policyState); every replica watches
//	               it and applies each change to its proxy's gate
//	ack.<replica>  what a replica last applied (policyAck), written after
//	               each change and every PolicySettings.Heartbeat, so a
//	               pause or resume can wait for every live replica
//
// A replica applies the state before its proxy serves a call, so one that
// starts while the policy is paused starts paused.
const (
	bucketPolicy   = "osmo_policy"
	keyPolicyState = "state"
	keyPolicyAck   = "ack."
)

// PolicySettings configure the policy's pause switch.
type PolicySettings struct {
	// Engines receive pauses and resumes (vLLM's or SGLang's endpoints);
	// nil means the upstreams of the rollouts this replica runs or ran.
	Engines llmproxy.EngineSet
	// AckTimeout bounds how long a pause or resume waits for every replica
	// (and its engines) to apply it (60s); the answer then names the
	// replicas that did not.
	AckTimeout time.Duration
	// Heartbeat is how often a replica rewrites its acknowledgement (5s);
	// one silent for three heartbeats is not waited for.
	Heartbeat time.Duration
	// StaleAction, when set (StaleFlag or StaleCancel), is what a rollout
	// gets whose oldest call's version is more than MaxStaleness below the
	// current one when it finishes (staleness.go); empty checks nothing.
	StaleAction  string
	MaxStaleness int64
}

// policyState is the shared switch.
type policyState struct {
	Paused  bool               `json:"paused"`
	Mode    llmproxy.PauseMode `json:"mode,omitempty"`
	Version int64              `json:"version"`
	// Epoch counts the changes; replicas acknowledge each.
	Epoch int64     `json:"epoch"`
	By    string    `json:"by,omitempty"`
	At    time.Time `json:"at,omitzero"`
}

// policyAck is a replica's acknowledgement.
type policyAck struct {
	Replica string    `json:"replica"`
	Epoch   int64     `json:"epoch"`
	Paused  bool      `json:"paused"`
	Error   string    `json:"error,omitempty"`
	Seen    time.Time `json:"seen"`
}

// policy is this replica's side of the shared switch.
type policy struct {
	kv        jetstream.KeyValue
	gate      *llmproxy.Gate
	replica   string
	log       *slog.Logger
	timeout   time.Duration
	heartbeat time.Duration

	// next hands the newest state to the goroutine applying states, so a
	// slow one (a wait pause draining) neither stops the heartbeat nor
	// holds a newer state back: the newer one cancels it (cancelApply).
	next chan policyState
	// running counts the goroutines start began: the one applying states
	// and the watcher, which deletes this replica's acknowledgement last.
	running sync.WaitGroup

	mu          sync.Mutex
	applied     policyState
	err         string // the last apply's failure
	cancelApply context.CancelFunc
}

func openPolicy(ctx context.Context, st *natsstore.Store) (jetstream.KeyValue, error) {
	return keyValue(ctx, st, jetstream.KeyValueConfig{Bucket: bucketPolicy, Description: "osmo: the policy's pause switch", History: 1}, nil)
}

// read is the shared state and its revision (0 when never written).
func (p *policy) read(ctx context.Context) (policyState, uint64, error) {
	e, err := p.kv.Get(ctx, keyPolicyState)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return policyState{}, 0, nil
	}
	if err != nil {
		return policyState{}, 0, err
	}
	var st policyState
	if err := json.Unmarshal(e.Value(), &st); err != nil {
		return policyState{}, 0, fmt.Errorf("rollout: policy state: %w", err)
	}
	return st, e.Revision(), nil
}

// change applies f to the shared state, compare-and-swap, until it sticks.
// f returns false to leave the state as it is.
func (p *policy) change(ctx context.Context, f func(st *policyState) (bool, error)) (policyState, error) {
	for {
		cur, rev, err := p.read(ctx)
		if err != nil {
			return cur, unavailable(err)
		}
		next := cur
		changed, err := f(&next)
		if err != nil || !changed {
			return cur, err
		}
		next.Epoch++
		next.By, next.At = p.replica, time.Now().UTC()
		b, _ := json.Marshal(next)
		if rev == 0 {
			_, err = p.kv.Create(ctx, keyPolicyState, b)
		} else {
			_, err = p.kv.Update(ctx, keyPolicyState, b, rev)
		}
		switch {
		case err == nil:
			return next, nil
		case errors.Is(err, jetstream.ErrKeyExists) || isWrongSequence(err):
			continue // another replica changed it first
		case ctx.Err() != nil:
			return cur, status.FromContextError(ctx.Err()).Err()
		default:
			return cur, unavailable(err)
		}
	}
}

// start applies the state before the proxy serves, then follows it and
// keeps this replica's acknowledgement fresh until ctx ends.
func (p *policy) start(ctx context.Context, store *natsstore.Store) error {
	// A bucket just created in a cluster may have no leader yet: the first
	// read and the watch are retried while JetStream is not ready.
	var (
		st policyState
		w  jetstream.KeyWatcher
	)
	err := store.Setup(ctx, "policy state", func(ctx context.Context) (err error) {
		if st, _, err = p.read(ctx); err != nil {
			return fmt.Errorf("rollout: reading the policy state: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	p.apply(ctx, st)
	err = store.Setup(ctx, "policy watch", func(ctx context.Context) (err error) {
		if w, err = p.kv.Watch(ctx, keyPolicyState); err != nil {
			return fmt.Errorf("rollout: watching the policy state: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	p.next = make(chan policyState, 1)
	p.running.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case st := <-p.next:
				p.apply(ctx, st)
			}
		}
	})
	p.running.Go(func() {
		defer func() {
			_ = w.Stop()
			// Gone replicas are not waited for.
			dctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_ = p.kv.Delete(dctx, keyPolicyAck+natsstore.Key(p.replica))
		}()
		beat := time.NewTicker(p.heartbeat)
		defer beat.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case e, ok := <-w.Updates():
				if !ok {
					return
				}
				if e == nil || e.Operation() != jetstream.KeyValuePut {
					continue
				}
				var st policyState
				if err := json.Unmarshal(e.Value(), &st); err != nil {
					p.log.Error("rollout: unreadable policy state", "error", err)
					continue
				}
				p.offer(st)
			case <-beat.C:
				p.ack(ctx)
			}
		}
	})
	return nil
}

// offer hands st to the applying goroutine, cancelling the state being
// applied: st supersedes it. Only the watcher sends, so the send after
// emptying the slot never blocks; it is made under p.mu so that apply,
// arming its cancel under p.mu, either is cancelled here or sees st
// waiting.
func (p *policy) offer(st policyState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cancelApply != nil {
		p.cancelApply()
	}
	select {
	case <-p.next:
	default:
	}
	p.next <- st
}

// apply brings the gate to st (unless it already is) and acknowledges.
func (p *policy) apply(ctx context.Context, st policyState) {
	p.mu.Lock()
	done := p.applied.Epoch >= st.Epoch && st.Epoch > 0
	p.mu.Unlock()
	if !done {
		actx, cancel := context.WithTimeout(ctx, p.timeout)
		p.mu.Lock()
		p.cancelApply = cancel
		if len(p.next) > 0 {
			cancel() // offered before the cancel was armed: st is superseded
		}
		p.mu.Unlock()
		var err error
		if st.Paused {
			err = p.gate.Pause(actx, st.Mode)
		} else {
			err = p.gate.Open(actx, st.Version)
		}
		superseded := errors.Is(actx.Err(), context.Canceled) && ctx.Err() == nil
		cancel()
		p.mu.Lock()
		p.cancelApply = nil
		p.mu.Unlock()
		if err != nil && superseded {
			// A newer state came meanwhile; it is applied next.
			return
		}
		p.mu.Lock()
		p.applied, p.err = st, ""
		if err != nil {
			p.err = err.Error()
		}
		p.mu.Unlock()
		if err != nil {
			p.log.Error("rollout: applying the policy state", "paused", st.Paused, "mode", st.Mode, "version", st.Version, "error", err)
		} else {
			p.log.Info("rollout: policy state applied", "paused", st.Paused, "mode", st.Mode, "version", st.Version, "epoch", st.Epoch)
		}
	}
	p.ack(ctx)
}

func (p *policy) ack(ctx context.Context) {
	p.mu.Lock()
	a := policyAck{Replica: p.replica, Epoch: p.applied.Epoch, Paused: p.applied.Paused, Error: p.err, Seen: time.Now().UTC()}
	p.mu.Unlock()
	b, _ := json.Marshal(a)
	if _, err := p.kv.Put(ctx, keyPolicyAck+natsstore.Key(p.replica), b); err != nil && ctx.Err() == nil {
		p.log.Warn("rollout: writing the policy acknowledgement", "error", err)
	}
}

// acks are the live replicas' acknowledgements.
func (p *policy) acks(ctx context.Context) (map[string]policyAck, error) {
	out := map[string]policyAck{}
	lister, err := p.kv.ListKeysFiltered(ctx, keyPolicyAck+">")
	if err != nil {
		return nil, err
	}
	for k := range lister.Keys() {
		e, err := p.kv.Get(ctx, k)
		if err != nil {
			continue // deleted meanwhile
		}
		var a policyAck
		if json.Unmarshal(e.Value(), &a) == nil && !p.silent(a) {
			out[a.Replica] = a
		}
	}
	return out, nil
}

// silent reports whether the replica that wrote a has written nothing for
// three heartbeats: gone, and not waited for.
func (p *policy) silent(a policyAck) bool { return time.Since(a.Seen) >= 3*p.heartbeat }

// await waits until every live replica applied epoch, or fails naming
// those that did not, or that failed to.
func (p *policy) await(ctx context.Context, epoch int64) error {
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	w, err := p.kv.Watch(ctx, keyPolicyAck+">")
	if err != nil {
		return unavailable(err)
	}
	defer func() { _ = w.Stop() }()
	live, err := p.acks(ctx)
	if err != nil {
		return unavailable(err)
	}
	pending := func() (waiting []string, failed []string) {
		for name, a := range live {
			switch {
			case a.Epoch < epoch:
				waiting = append(waiting, name)
			case a.Error != "":
				failed = append(failed, name+": "+a.Error)
			}
		}
		slices.Sort(waiting)
		slices.Sort(failed)
		return waiting, failed
	}
	// A replica killed meanwhile writes no more acknowledgements: once
	// silent for three heartbeats it is not waited for, as one silent
	// before the wait began is not.
	silent := time.NewTicker(p.heartbeat)
	defer silent.Stop()
	for {
		waiting, failed := pending()
		if len(waiting) == 0 && len(failed) > 0 {
			return status.Errorf(codes.Unavailable, "policy state %d failed on replica(s) %s", epoch, strings.Join(failed, "; "))
		}
		if len(waiting) == 0 {
			return nil
		}
		select {
		case e, ok := <-w.Updates():
			if !ok {
				return status.Errorf(codes.Unavailable, "policy acknowledgements: watch ended")
			}
			if e == nil {
				continue
			}
			var a policyAck
			if e.Operation() == jetstream.KeyValuePut && json.Unmarshal(e.Value(), &a) == nil {
				if _, known := live[a.Replica]; known {
					live[a.Replica] = a
				}
			} else if e.Operation() != jetstream.KeyValuePut {
				// A replica that shut down is not waited for.
				for name := range live {
					if keyPolicyAck+natsstore.Key(name) == e.Key() {
						delete(live, name)
					}
				}
			}
		case <-silent.C:
			for name, a := range live {
				if p.silent(a) {
					delete(live, name)
				}
			}
		case <-ctx.Done():
			return status.Errorf(codes.DeadlineExceeded, "policy state %d not applied within %s by replica(s) %s", epoch, p.timeout, strings.Join(waiting, ", "))
		}
	}
}

// render is the state as the API shows it.
func (p *policy) render(ctx context.Context, st policyState) (*rolloutv1.PolicyState, error) {
	out := &rolloutv1.PolicyState{Paused: st.Paused, Mode: string(st.Mode), Version: int32(st.Version), Epoch: st.Epoch}
	for _, e := range p.gate.State().Engines {
		out.Engines = append(out.Engines, &rolloutv1.PolicyEngine{BaseUrl: e.BaseURL, Api: e.API, Paused: e.Paused, Error: e.Error})
	}
	acks, err := p.acks(ctx)
	if err != nil {
		return nil, unavailable(err)
	}
	names := make([]string, 0, len(acks))
	for n := range acks {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		a := acks[n]
		out.Replicas = append(out.Replicas, &rolloutv1.PolicyReplica{Name: n, Epoch: a.Epoch, Paused: a.Paused, Error: a.Error, Seen: timestamppb.New(a.Seen)})
	}
	return out, nil
}

// PausePolicy pauses the policy on every replica; see PolicySettings. A
// pause while paused keeps the pause with the stronger mode (abort over
// wait over keep) and answers once that is applied.
func (s *Service) PausePolicy(ctx context.Context, req *rolloutv1.PausePolicyRequest) (*rolloutv1.PolicyState, error) {
	mode, err := llmproxy.ParsePauseMode(req.GetMode())
	if err != nil {
		return nil, fielderr.New("mode", "must be keep, wait or abort, got %q", req.GetMode())
	}
	p := s.policy
	st, err := p.change(ctx, func(st *policyState) (bool, error) {
		switch {
		case !st.Paused:
			st.Paused, st.Mode = true, mode
			return true, nil
		case mode.Strength() > st.Mode.Strength():
			st.Mode = mode
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("rollout: policy pause", "mode", st.Mode, "version", st.Version, "epoch", st.Epoch)
	if err := p.await(ctx, st.Epoch); err != nil {
		return nil, err
	}
	return p.render(ctx, st)
}

// ResumePolicy ends the pause at req.version on every replica. A version
// below the current one, or a resume when not paused to another version,
// is AlreadyExists (REST 409); the same resume repeated answers the state.
func (s *Service) ResumePolicy(ctx context.Context, req *rolloutv1.ResumePolicyRequest) (*rolloutv1.PolicyState, error) {
	v := int64(req.GetVersion())
	if v < 0 {
		return nil, fielderr.New("version", "must not be negative, got %d", v)
	}
	p := s.policy
	st, err := p.change(ctx, func(st *policyState) (bool, error) {
		switch {
		case v < st.Version:
			return false, status.Errorf(codes.AlreadyExists, "version: %d is below the current policy version %d", v, st.Version)
		case !st.Paused && v == st.Version:
			return false, nil
		case !st.Paused:
			return false, status.Errorf(codes.AlreadyExists, "version: the policy is not paused (version %d); pause it before resuming to %d", st.Version, v)
		}
		st.Paused, st.Mode, st.Version = false, "", v
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("rollout: policy resume", "version", st.Version, "epoch", st.Epoch)
	if err := p.await(ctx, st.Epoch); err != nil {
		return nil, err
	}
	return p.render(ctx, st)
}

// GetPolicy reads the shared policy state.
func (s *Service) GetPolicy(ctx context.Context, _ *rolloutv1.GetPolicyRequest) (*rolloutv1.PolicyState, error) {
	st, _, err := s.policy.read(ctx)
	if err != nil {
		return nil, unavailable(err)
	}
	return s.policy.render(ctx, st)
}

// enginesUp are the policy engines in the ring, those a pause goes to: one
// out of it (dead, or failing its probes) could not take the pause, and it
// gets no calls while the gate holds them. One paused before it left is
// still resumed (Gate remembers it).
type enginesUp struct{ set *llmproxy.Engines }

// URLs implements llmproxy.EngineSet.
func (e enginesUp) URLs() []string {
	return slices.DeleteFunc(e.set.URLs(), func(u string) bool { return !e.set.Up(u) })
}

// engineUnion is the engines of several sets, each once.
type engineUnion []llmproxy.EngineSet

// URLs implements llmproxy.EngineSet.
func (u engineUnion) URLs() []string {
	var out []string
	for _, set := range u {
		for _, url := range set.URLs() {
			if !slices.Contains(out, url) {
				out = append(out, url)
			}
		}
	}
	return out
}

// upstreams is the default engine set: the distinct upstreams of the
// rollouts this replica ran, the most recent first, up to a bound.
type upstreams struct {
	mu   sync.Mutex
	urls []string
}

const maxUpstreams = 64

func (u *upstreams) add(url string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if i := slices.Index(u.urls, url); i >= 0 {
		u.urls = slices.Delete(u.urls, i, i+1)
	}
	u.urls = slices.Insert(u.urls, 0, url)
	if len(u.urls) > maxUpstreams {
		u.urls = u.urls[:maxUpstreams]
	}
}

// URLs implements llmproxy.EngineSet.
func (u *upstreams) URLs() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.urls)
}
