package grader

import (
	"cmp"
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
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/singleflight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/cenkalti/backoff/v5"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
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
	tracer  trace.Tracer
	prop    propagation.TextMapPropagator

	// ctx ends at Close; gradings run under it, so one outlives a client
	// that disconnects and answers its resend.
	ctx    context.Context
	cancel context.CancelFunc

	mu sync.Mutex     // orders Close after wg.Add
	wg sync.WaitGroup // gradings in progress
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
		tracer:  cmp.Or[trace.TracerProvider](cfg.TracerProvider, noop.NewTracerProvider()).Tracer(tracerName),
		prop:    cmp.Or[propagation.TextMapPropagator](cfg.Propagator, propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Close stops the service: gradings in progress are abandoned (neither
// stored nor answered), later requests fail with Unavailable, and
// Config.State stays open.
func (s *Service) Close() error {
	s.mu.Lock()
	s.cancel()
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *Service) isClosed() bool { return s.ctx.Err() != nil }

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
// service), answering as GradeStream does: an invalid request is an answer
// with Error set. While the gradings cannot be read it tries again, as a
// stream's client resends, until ctx ends.
//
// A first attempt's grading is not stored: the bucket answers resends of
// answers lost on their way, and an answer in process is never lost. A
// retry here is no first attempt, and is stored.
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

// invalidAnswer answers a request refused as invalid (st) with Error set.
func invalidAnswer(req *graderv1.GradeRequest, st *status.Status) *graderv1.GradeResponse {
	return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), RequestId: req.GetRequestId(), Grader: req.GetGrader(),
		Error: "invalid request: " + st.Message(), ErrorCategory: string(outcome.Validation)}
}

// GradeStream implements graderv1.GraderServiceServer. Requests are graded
// concurrently (at most Config.MaxConcurrent per stream) and answered as
// they complete; an invalid one is answered with Error set. The stream ends
// when the client closes its side (once answers in progress are sent) or
// goes away, or with Unavailable when the service is closed.
func (s *Service) GradeStream(stream graderv1.GraderService_GradeStreamServer) error {
	ctx, cancel := context.WithCancelCause(stream.Context())
	defer cancel(nil)
	// A closing service ends the stream, idle or not.
	stopClose := context.AfterFunc(s.ctx, func() { cancel(status.Error(codes.Unavailable, errShutdown.Error())) })
	defer stopClose()

	// Recv runs on its own goroutine so a closing service can end the
	// stream while the client is idle.
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
			resp, err := s.answer(ctx, req, true)
			if err != nil {
				st := status.Convert(err)
				switch st.Code() {
				case codes.InvalidArgument:
					s.log.WarnContext(ctx, "invalid grade request", "rollout_id", req.GetRolloutId(), "error", st.Message())
					resp = invalidAnswer(req, st)
				case codes.Unavailable:
					// End the stream so the client resends, maybe elsewhere.
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
				s.log.DebugContext(ctx, "grade answer not sent; the client will resend", "rollout_id", resp.GetRolloutId(), "error", err)
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
// statuses: InvalidArgument, Unavailable (closed, or the gradings cannot be
// read), or ctx's. Unreadable gradings fail the request rather than have it
// graded blind: an LLM judge is neither cheap nor deterministic, and the
// client resends on Unavailable, so an outage costs latency only.
func (s *Service) answer(ctx context.Context, greq *graderv1.GradeRequest, keep bool) (resp *graderv1.GradeResponse, err error) {
	req, err := readRequest(greq)
	ctx, span := s.startGrade(ctx, greq, req)
	defer func() {
		endGrade(span, resp, err)
		span.End()
	}()
	if err != nil {
		return nil, err
	}
	name := req.GetGrader()
	if name == "" {
		if s.cfg.Default == "" {
			return nil, fielderr.New("grader", "required: this service has no default grader (known: %s)", strings.Join(s.cfg.graderNames(), ", "))
		}
		name = s.cfg.Default
	}
	g, ok := s.cfg.Graders[name]
	if !ok {
		return nil, fielderr.New("grader", "unknown grader %q (known: %s)", name, strings.Join(s.cfg.graderNames(), ", "))
	}
	if s.isClosed() {
		return nil, status.Error(codes.Unavailable, errShutdown.Error())
	}
	rid := req.GetRolloutId()
	log := s.log.With("rollout_id", rid)
	ids := make([]string, len(req.samples))
	for i, s := range req.samples {
		ids[i] = s.ID
	}
	// A grading that is not kept answers only the request that led its
	// pass, so it needs no fingerprints to match later ones.
	var fps map[string]string
	if keep {
		var err error
		if fps, err = fingerprints(name, req); err != nil {
			return nil, fielderr.New("samples", "%v", err)
		}
	}
	// A request leads a pass of its rollout (gradeMissing) or waits for the
	// one in progress, which may have covered other samples, or these with
	// other content, and then looks again. Passes of one rollout never
	// overlap, so the latest grading of a sample is the last stored.
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
			o, ok := fr.answerFor(id, fps[id], led)
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
	resp = respond(rid, ids, found)
	resp.RequestId = req.GetRequestId()
	return resp, nil
}

// flightResult is what one grading pass of a rollout offers its waiters,
// who take an outcome only for a sample they sent with the same fingerprint.
type flightResult struct {
	gradings []*grading
	fresh    *grading // graded in this pass; nil if all were stored already
}

// answerFor is the answer for id with fingerprint fp. The request that led
// the pass (led) takes the pass's fresh grading of the samples it sent,
// after any stored one that answers fp (fresh is last in gradings).
func (f *flightResult) answerFor(id, fp string, led bool) (answer, bool) {
	for _, g := range f.gradings {
		if r, ok := g.sample(id); ok && (r.answers(fp) || led && g == f.fresh) {
			return answer{g: g, r: r}, true
		}
	}
	return answer{}, false
}

// gradeMissing is one grading pass: it looks in the store (a pass that just
// ended, here or on another replica, may have stored these samples), grades
// what is still missing, and stores the grading before anyone is answered
// (unless keep is false: see GradeLocal). tctx carries the leading
// request's trace; the pass runs under the service's context.
func (s *Service) gradeMissing(tctx context.Context, name string, g osmo.Grader, req *request, ids []string, fps map[string]string, keep bool, log *slog.Logger) (*flightResult, error) {
	s.mu.Lock()
	if s.isClosed() {
		s.mu.Unlock()
		return nil, errShutdown
	}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()

	// A first attempt has nothing stored to find (its sender says so): the
	// read, a round trip to NATS per rollout, is skipped.
	var stored gradingList
	if !req.GetFirstAttempt() {
		var err error
		if stored, _, err = s.store.get(tctx, req.GetRolloutId()); err != nil {
			return nil, err
		}
	}
	found, missing, changed := stored.lookup(ids, fps, s.store.ttl, time.Now())
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
	committed := !keep || s.commit(tctx, gr, log)
	s.metrics.observe(gr, time.Since(start))
	if gr.Error == "" && committed {
		// Logged once stored: no replica or restart will repeat it.
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
// stored is still answered: its result is right, and only a resend could
// grade these samples again. The write has a deadline of its own and is
// not cut short by Close.
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
