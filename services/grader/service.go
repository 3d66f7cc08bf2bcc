package grader

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/singleflight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/cenkalti/backoff/v5"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/internal/retry"
)

// Service is the grader service. Create it with New and release it with
// Close.
type Service struct {
	graderv1.UnimplementedGraderServiceServer

	cfg     Config
	log     *slog.Logger
	store   *store
	flight  singleflight.Group
	slots   chan struct{} // one per running grader
	metrics *metrics
	tracer  trace.Tracer // nil when not tracing
	prop    propagation.TextMapPropagator

	// ctx ends at Close; gradings run under it, not under the request's
	// context, so a grading outlives a client that disconnects and its
	// result answers the client's resend.
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup // gradings in progress
}

var _ graderv1.GraderServiceServer = (*Service)(nil)

// New builds a Service, creating the gradings bucket in cfg.State if it
// does not exist yet (or setting its TTL to cfg.ResultTTL).
func New(ctx context.Context, cfg Config) (*Service, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, fmt.Errorf("grader.New: %w", err)
	}
	st, err := openStore(ctx, cfg.State, cfg.ResultTTL, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("grader.New: %w", err)
	}
	s := &Service{
		cfg:     cfg,
		log:     cfg.Logger,
		store:   st,
		slots:   make(chan struct{}, cfg.MaxConcurrent),
		metrics: newMetrics(cfg.Metrics),
		prop:    cfg.Propagator,
	}
	if cfg.TracerProvider != nil {
		s.tracer = cfg.TracerProvider.Tracer(tracerName)
	}
	if s.prop == nil {
		s.prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Close stops the service: gradings in progress are abandoned (neither
// stored nor answered, so the client's resend is graded wherever it goes
// next), and later requests fail with Unavailable. Config.State stays
// open: it is the caller's.
func (s *Service) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	return nil
}

func (s *Service) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Grade implements graderv1.GraderServiceServer. Invalid requests fail with
// InvalidArgument naming the field; a grader's failure is an answer with
// Error set, not an RPC error.
func (s *Service) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	return s.grade(ctx, req, true)
}

// grade is Grade; keep says whether a fresh grading is stored for resends.
func (s *Service) grade(ctx context.Context, req *graderv1.GradeRequest, keep bool) (*graderv1.GradeResponse, error) {
	resp, err := s.answer(ctx, req, keep)
	if err != nil {
		s.log.WarnContext(ctx, "grade request not answered", "rollout_id", req.GetRolloutId(), "error", err)
		return nil, err
	}
	return resp, nil
}

// GradeLocal grades req for a caller in this process (osmo serve's rollout
// service), answering as GradeStream answers a client: an invalid request
// is an answer with Error set (a validation failure), not an error. While
// the gradings cannot be read (the shared state is unreachable), it tries
// again, as a stream's client resends, 100 ms doubling to 2 s apart, until
// ctx ends.
//
// A first attempt's grading is not stored: the bucket is there to answer
// a resend of a request whose answer was lost on its way, and an answer
// in process is not. Its caller grades each rollout once and never asks
// again (a retry here is no first attempt, and is stored). That is a
// NATS write per rollout that osmo serve does not make.
func (s *Service) GradeLocal(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	var last error
	tries := 0
	resp, err := backoff.Retry(ctx, func() (*graderv1.GradeResponse, error) {
		if tries++; tries == 2 && req.GetFirstAttempt() {
			// Tried again, it is a resend.
			req = proto.CloneOf(req)
			req.FirstAttempt = false
		}
		resp, err := s.grade(ctx, req, !req.GetFirstAttempt())
		last = err
		switch status.Code(err) {
		case codes.OK:
			return resp, nil
		case codes.InvalidArgument:
			return invalidAnswer(req, status.Convert(err)), nil
		case codes.Unavailable:
			if !s.isClosed() {
				return nil, err
			}
		}
		return nil, backoff.Permanent(err)
	},
		backoff.WithBackOff(retry.SharedState()),
		backoff.WithMaxElapsedTime(0)) // until ctx ends
	if err != nil && last != nil {
		err = last // ended while waiting: the grader's answer says more
	}
	return resp, err
}

// invalidAnswer is the answer to a request refused as invalid (st): an
// answer with Error set, a validation failure, for callers that take
// answers rather than errors.
func invalidAnswer(req *graderv1.GradeRequest, st *status.Status) *graderv1.GradeResponse {
	return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), RequestId: req.GetRequestId(), Grader: req.GetGrader(),
		Error: "invalid request: " + st.Message(), ErrorCategory: string(outcome.Validation)}
}

// GradeStream implements graderv1.GraderServiceServer. Requests are graded
// concurrently (at most Config.MaxConcurrent in progress per stream) and
// answered as they complete. An invalid request is answered with Error set;
// the stream goes on. The stream ends when the client closes its side (after
// the answers in progress are sent), when it goes away, or with Unavailable
// when the service is closed.
func (s *Service) GradeStream(stream graderv1.GraderService_GradeStreamServer) error {
	ctx, cancel := context.WithCancelCause(stream.Context())
	defer cancel(nil)

	// Recv runs on its own goroutine so a closing service can end the
	// stream while the client is idle; it returns once the stream ends.
	reqs := make(chan *graderv1.GradeRequest)
	recvErr := make(chan error, 1)
	go func() {
		for {
			req, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case reqs <- req:
			case <-ctx.Done():
				return
			}
		}
	}()

	var (
		sendMu   sync.Mutex
		workers  sync.WaitGroup
		inflight = make(chan struct{}, s.cfg.MaxConcurrent)
	)
	defer workers.Wait()
	for {
		var req *graderv1.GradeRequest
		select {
		case req = <-reqs:
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case <-ctx.Done():
			return streamEnd(ctx)
		}
		select {
		case inflight <- struct{}{}:
		case <-ctx.Done():
			return streamEnd(ctx)
		}
		workers.Add(1)
		go func() {
			defer workers.Done()
			defer func() { <-inflight }()
			rctx := ctx
			resp, err := s.answer(rctx, req, true)
			if err != nil {
				st := status.Convert(err)
				switch st.Code() {
				case codes.InvalidArgument:
					s.log.WarnContext(rctx, "invalid grade request", "rollout_id", req.GetRolloutId(), "error", st.Message())
					resp = invalidAnswer(req, st)
				case codes.Unavailable:
					// Closing, or the gradings cannot be read: end the stream
					// so the client reconnects (to another replica, maybe)
					// and resends.
					cancel(err)
					return
				default:
					// The stream is gone; the client resends on its next one.
					return
				}
			}
			sendMu.Lock()
			defer sendMu.Unlock()
			if err := stream.Send(resp); err != nil {
				s.log.DebugContext(rctx, "grade answer not sent; the client will resend", "rollout_id", resp.GetRolloutId(), "error", err)
				cancel(err)
			}
		}()
	}
}

// streamEnd is the status a stream handler returns when ctx ended.
func streamEnd(ctx context.Context) error {
	cause := context.Cause(ctx)
	if _, ok := status.FromError(cause); ok {
		return cause
	}
	return status.FromContextError(ctx.Err()).Err()
}

// answer grades req or answers it from earlier gradings. Errors are gRPC
// statuses: InvalidArgument for bad requests, Unavailable when the service
// is closed or the stored gradings cannot be read, and the context's
// status when ctx ends first.
//
// A request whose stored gradings cannot be read (NATS unreachable) fails
// rather than being graded: grading it blind could grade a sample twice
// and answer a second, different reward for it (an LLM judge is neither
// cheap nor deterministic), which is what the store is for. The client
// resends on Unavailable until its deadline, so an outage of NATS costs
// latency, not a duplicate grading.
func (s *Service) answer(ctx context.Context, req *graderv1.GradeRequest, keep bool) (*graderv1.GradeResponse, error) {
	r, err := readRequest(req)
	ctx, span := s.startGrade(ctx, req, r)
	defer span.End()
	if err == nil {
		var resp *graderv1.GradeResponse
		resp, err = s.answerRead(ctx, r, keep)
		endGrade(span, resp, err)
		return resp, err
	}
	endGrade(span, nil, err)
	return nil, err
}

// answerRead is answer of a request read and checked.
func (s *Service) answerRead(ctx context.Context, req *request, keep bool) (*graderv1.GradeResponse, error) {
	name := req.GetGrader()
	if name == "" {
		if s.cfg.Default == "" {
			return nil, badField("grader", "required: this service has no default grader (known: %s)", strings.Join(s.cfg.graderNames(), ", "))
		}
		name = s.cfg.Default
	}
	g, ok := s.cfg.Graders[name]
	if !ok {
		return nil, badField("grader", "unknown grader %q (known: %s)", name, strings.Join(s.cfg.graderNames(), ", "))
	}
	if s.isClosed() {
		return nil, status.Error(codes.Unavailable, errShutdown.Error())
	}
	rid := req.GetRolloutId()
	log := s.log.With("rollout_id", rid)
	ids := sampleIDs(req)
	// Fingerprints match a grading to a later request, through the store,
	// or to a request that waits for the pass: one that is not kept
	// answers the request that led its pass only, and needs none.
	var fps map[string]string
	if keep {
		var err error
		if fps, err = fingerprints(name, req); err != nil {
			return nil, badField("samples", "%v", err)
		}
	}
	// Each pass looks the rollout's stored gradings up (a pass that just
	// ended, here or on another replica, may have stored these samples),
	// grades what is missing and stores it; a request either leads a pass
	// or waits for the one of this rollout in progress, which may have
	// covered other samples than these, or these samples with other
	// content (another rollout reusing the id), and then looks again.
	// Passes of one rollout never overlap, so the latest grading of a
	// sample is the last stored. The store is read in the pass only: a
	// read before it would be repeated there.
	found := make(map[string]answer, len(ids))
	for missing := ids; len(missing) > 0; {
		want := missing
		led := false
		ch := s.flight.DoChan(rid, func() (any, error) {
			led = true
			// The pass outlives this request if it goes away; its context
			// only parents the pass's spans and logs.
			return s.gradeMissing(context.WithoutCancel(ctx), name, g, req, want, fps, keep, log)
		})
		var res singleflight.Result
		select {
		case res = <-ch:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		if res.Err != nil {
			return nil, status.Error(codes.Unavailable, res.Err.Error())
		}
		fr := res.Val.(*flightResult)
		missing = nil
		for _, id := range want {
			o, ok := fr.answerFor(id, fps[id])
			if !ok && led {
				o, ok = fr.own(id)
			}
			if !ok {
				missing = append(missing, id)
				continue
			}
			o.fresh = led && o.g == fr.fresh
			found[id] = o
		}
	}
	for _, o := range found {
		if !o.fresh {
			s.metrics.cached.Inc()
		}
	}
	resp := respond(rid, ids, found)
	resp.RequestId = req.GetRequestId()
	return resp, nil
}

// flightResult is what one grading pass of a rollout offers its waiters:
// the gradings covering the samples it was asked for, as its leader sent
// them. A waiter takes an outcome only for a sample it sent with the same
// fingerprint.
type flightResult struct {
	gradings []*grading
	fresh    *grading // graded in this pass; nil if all were stored already
}

// own is the answer for id from the grading this pass made, to the
// request that led the pass: the samples it sent are those graded.
func (f *flightResult) own(id string) (answer, bool) {
	if f.fresh == nil {
		return answer{}, false
	}
	r, ok := f.fresh.sample(id)
	return answer{g: f.fresh, r: r}, ok
}

func (f *flightResult) answerFor(id, fp string) (answer, bool) {
	for _, g := range f.gradings {
		if r, ok := g.sample(id); ok && r.answers(fp) {
			return answer{g: g, r: r}, true
		}
	}
	return answer{}, false
}

// gradeMissing is one grading pass: it looks in the store (a pass
// that just ended, here or on another replica, may have stored these
// samples), grades what is still missing, and stores the grading before
// anyone is answered (unless keep is false: see GradeLocal). tctx carries the trace of the request that leads the
// pass; the pass runs under the service's context.
func (s *Service) gradeMissing(tctx context.Context, name string, g osmo.Grader, req *request, ids []string, fps map[string]string, keep bool, log *slog.Logger) (*flightResult, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errShutdown
	}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()

	// A first attempt has nothing stored to find (its sender says so),
	// and each rollout the rollout service runs is one: the read is
	// skipped, and with it a round trip to NATS per rollout.
	var (
		found   map[string]answer
		missing = ids
		changed int
	)
	if !req.GetFirstAttempt() {
		var err error
		if found, missing, changed, err = s.store.lookup(tctx, req.GetRolloutId(), ids, fps, time.Now()); err != nil {
			return nil, err
		}
	}
	fr := &flightResult{}
	for _, o := range found {
		fr.gradings = append(fr.gradings, o.g)
	}
	if len(missing) == 0 {
		log.DebugContext(tctx, "answered from an earlier grading", "samples", len(ids))
		return fr, nil
	}
	if changed > 0 {
		// A new rollout reusing the id, or a request that is not a resend.
		log.InfoContext(tctx, "grading anew samples whose earlier grading was of other content", "grader", name, "samples", changed)
	}
	start := time.Now()
	gr, err := s.run(tctx, name, g, req, missing, log)
	if err != nil {
		return nil, err
	}
	for i := range gr.Samples {
		gr.Samples[i].Fingerprint = fps[gr.Samples[i].ID]
	}
	stored := !keep || s.commit(tctx, gr, log)
	s.metrics.observe(gr, time.Since(start))
	if gr.Error == "" && stored {
		// Logged only once the grading is stored: each "graded" record is
		// a grading no replica and no restart will repeat.
		log.InfoContext(tctx, "graded", "grader", name, "samples", len(missing), "duration_ms", time.Since(start).Milliseconds())
	}
	fr.fresh = gr
	fr.gradings = append(fr.gradings, gr)
	return fr, nil
}

// commitTimeout bounds the storing of one grading, its compare-and-set
// retries included: long enough to ride out a NATS leader election.
const commitTimeout = 10 * time.Second

// commit stores gr and reports whether it did. A grading that cannot be
// stored (NATS unreachable) is still answered, since the grader's work is
// done and its result is right: only a resend could grade these samples
// again. The write gets a deadline of its own (tctx has none) and is not
// cut short by Close, so a grading that finished is stored.
func (s *Service) commit(tctx context.Context, gr *grading, log *slog.Logger) bool {
	ctx, cancel := context.WithTimeout(tctx, commitTimeout)
	defer cancel()
	if err := s.store.add(ctx, gr); err != nil {
		log.ErrorContext(tctx, "grading not stored; a resend may grade these samples again", "error", err)
		return false
	}
	return true
}

// respond builds the answer for ids from their outcomes. Any failed grading
// makes the whole answer that error, without rewards.
func respond(rolloutID string, ids []string, found map[string]answer) *graderv1.GradeResponse {
	resp := &graderv1.GradeResponse{RolloutId: rolloutID}
	var errs []string
	for _, id := range ids {
		o := found[id]
		if resp.Grader == "" || o.fresh {
			resp.Grader = o.g.Grader
		}
		if o.g.Error != "" {
			if !slices.Contains(errs, o.g.Error) {
				errs = append(errs, o.g.Error)
			}
			if resp.ErrorCategory == "" {
				resp.ErrorCategory = string(o.g.Category)
			}
			continue
		}
		sg := &graderv1.SampleGrade{SampleId: id, RemoveSample: o.r.Remove, Cached: !o.fresh}
		if o.r.Reward != nil {
			r := *o.r.Reward
			sg.Reward = &r
		}
		resp.Grades = append(resp.Grades, sg)
	}
	if len(errs) > 0 {
		resp.Error = strings.Join(errs, "; ")
		resp.Grades = nil
	}
	return resp
}
