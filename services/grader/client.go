package grader

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/retry"
)

// Defaults of ClientOptions.
const (
	DefaultReconnectMin = 100 * time.Millisecond
	DefaultReconnectMax = 5 * time.Second
)

// ClientOptions configure a Client. Zero values take the documented defaults.
type ClientOptions struct {
	// Logger receives structured logs (slog.Default()).
	Logger *slog.Logger
	// ReconnectMin and ReconnectMax bound the backoff between attempts to
	// open the stream (100ms, doubling up to 5s, ±20%).
	ReconnectMin, ReconnectMax time.Duration
	// Propagator writes Grade's trace context into trace_context (W3C trace
	// context and baggage when nil).
	Propagator propagation.TextMapPropagator
}

// Client grades rollouts over one GradeStream, which Run keeps open. A
// request stays pending until answered and is sent again on every new
// stream, so a grader that restarts delays answers but loses none. A Client
// is safe for concurrent use.
type Client struct {
	stub     graderv1.GraderServiceClient
	conn     grpc.ClientConnInterface
	log      *slog.Logger
	min, max time.Duration
	prop     propagation.TextMapPropagator
	running  atomic.Bool

	mu      sync.Mutex
	pending map[string]*call // by rollout id
	unsent  []*call          // pending calls not yet sent on the current stream
	seq     uint64
	wake    chan struct{} // tells the sender there is something in unsent
}

// call is one rollout's request waiting for its answer.
type call struct {
	req     *graderv1.GradeRequest
	waiters int
	done    chan struct{} // closed when resp or err is set
	resp    *graderv1.GradeResponse
	err     error
	gone    bool // answered or abandoned: never send again
	settled bool // done is closed
	sent    bool // went out on a stream (maybe half way): a resend is no first attempt
}

// NewClient returns a Client over conn. Call Run to connect.
func NewClient(conn grpc.ClientConnInterface, opts ClientOptions) *Client {
	if opts.ReconnectMin <= 0 {
		opts.ReconnectMin = DefaultReconnectMin
	}
	if opts.ReconnectMax <= 0 {
		opts.ReconnectMax = DefaultReconnectMax
	}
	opts.ReconnectMax = max(opts.ReconnectMax, opts.ReconnectMin)
	return &Client{
		stub:    graderv1.NewGraderServiceClient(conn),
		conn:    conn,
		log:     cmp.Or(opts.Logger, slog.Default()),
		min:     opts.ReconnectMin,
		max:     opts.ReconnectMax,
		prop:    cmp.Or[propagation.TextMapPropagator](opts.Propagator, propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
		pending: map[string]*call{},
		wake:    make(chan struct{}, 1),
	}
}

// Grade sends req and waits, while Run runs, for the answer for its rollout
// or for ctx; a Grade for a rollout already pending waits for that answer.
// A grader's failure is an answer with Error set; the error is for an
// invalid or unsendable request, or ctx. Grade sets request_id and, unless
// req has one, trace_context from ctx.
func (c *Client) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	if err := validateRolloutID(req); err != nil {
		return nil, fmt.Errorf("grader.Client.Grade: %w", err)
	}
	rid := req.GetRolloutId()
	c.mu.Lock()
	cl := c.pending[rid]
	if cl == nil {
		c.seq++
		// A copy: the caller may reuse req while it may still be resent.
		sent := proto.Clone(req).(*graderv1.GradeRequest)
		sent.RequestId = c.seq
		if len(sent.GetTraceContext()) == 0 {
			carrier := propagation.MapCarrier{}
			c.prop.Inject(ctx, carrier)
			if len(carrier) > 0 {
				sent.TraceContext = carrier
			}
		}
		cl = &call{req: sent, done: make(chan struct{})}
		c.pending[rid] = cl
		c.unsent = append(c.unsent, cl)
		c.signal()
	}
	cl.waiters++
	c.mu.Unlock()

	select {
	case <-cl.done:
		return cl.resp, cl.err // one of them is set
	case <-ctx.Done():
	}
	c.mu.Lock()
	cl.waiters--
	if cl.waiters == 0 && c.pending[rid] == cl {
		// Nobody waits any more: stop resending it; a late answer is dropped.
		delete(c.pending, rid)
		cl.gone = true
	}
	c.mu.Unlock()
	select {
	case <-cl.done:
		return cl.resp, cl.err // one of them is set
	default:
	}
	return nil, fmt.Errorf("grader.Client.Grade %s: %w", rid, ctx.Err())
}

// signal wakes the sender; c.mu must be held.
func (c *Client) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// finish settles cl with resp or err; c.mu must be held.
func (c *Client) finish(cl *call, resp *graderv1.GradeResponse, err error) {
	if cl.settled {
		return
	}
	if rid := cl.req.GetRolloutId(); c.pending[rid] == cl {
		delete(c.pending, rid)
	}
	cl.gone, cl.settled = true, true
	cl.resp, cl.err = resp, err
	close(cl.done)
}

// Run keeps one GradeStream open, reopening it with backoff, and returns
// nil when ctx ends. Only one Run may be active at a time.
func (c *Client) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("grader.Client.Run: already running")
	}
	defer c.running.Store(false)
	// Jittered so clients do not reconnect in step.
	b := retry.Doubling(c.min, c.max, 0.2)
	for {
		start := time.Now()
		answered, err := c.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if answered || time.Since(start) >= c.max {
			b.Reset() // the stream worked: start the backoff over
		}
		wait := b.NextBackOff()
		c.log.Warn("grade stream ended; reconnecting", "error", err, "retry_in", wait, "pending", c.pendingCount())
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		// The channel's own reconnect backoff (up to 2 minutes) is reset so
		// that ours decides how soon a restarted grader is reached.
		if r, ok := c.conn.(interface{ ResetConnectBackoff() }); ok {
			r.ResetConnectBackoff()
		}
	}
}

func (c *Client) pendingCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.pending)
}

// session runs one stream until it fails or ctx ends, reporting whether
// any answer arrived on it.
func (c *Client) session(ctx context.Context) (answered bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.stub.GradeStream(ctx)
	if err != nil {
		return false, fmt.Errorf("grader.Client: open stream: %w", err)
	}
	// Everything pending goes out again, oldest first: the old stream's
	// answers may never come.
	c.mu.Lock()
	c.unsent = c.unsent[:0]
	for _, cl := range c.pending {
		if cl.sent {
			// A grader may have graded and stored it: it is to look.
			cl.req.FirstAttempt = false
		}
		c.unsent = append(c.unsent, cl)
	}
	// Request ids number the calls in the order they were made.
	slices.SortFunc(c.unsent, func(a, b *call) int { return cmp.Compare(a.req.GetRequestId(), b.req.GetRequestId()) })
	resent := len(c.unsent)
	c.signal()
	c.mu.Unlock()
	if resent > 0 {
		c.log.Info("grade stream open; sending pending requests", "pending", resent)
	} else {
		c.log.Debug("grade stream open")
	}

	sendDone := make(chan error, 1)
	go func() { sendDone <- c.sendLoop(ctx, stream) }()
	defer func() {
		cancel()
		<-sendDone
	}()
	for {
		resp, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = errors.New("grader.Client: the grader closed the stream")
			}
			return answered, err
		}
		answered = true
		c.deliver(resp)
	}
}

// deliver hands resp to the call pending for its rollout if it answers
// that call's request, not an abandoned earlier one. An answer without a
// request id (a grader that does not echo it) goes by rollout id alone.
func (c *Client) deliver(resp *graderv1.GradeResponse) {
	rid := resp.GetRolloutId()
	c.mu.Lock()
	defer c.mu.Unlock()
	cl := c.pending[rid]
	if cl == nil || (resp.GetRequestId() != 0 && resp.GetRequestId() != cl.req.GetRequestId()) {
		c.log.Debug("grade answer for no pending request", "rollout_id", rid, "request_id", resp.GetRequestId())
		return
	}
	c.finish(cl, resp, nil)
}

// sendLoop sends unsent calls in order until ctx ends or a send fails.
func (c *Client) sendLoop(ctx context.Context, stream graderv1.GraderService_GradeStreamClient) error {
	for {
		c.mu.Lock()
		var next *call
		for len(c.unsent) > 0 && next == nil {
			next = c.unsent[0]
			c.unsent[0] = nil
			c.unsent = c.unsent[1:]
			if next.gone {
				next = nil
			}
		}
		c.mu.Unlock()
		if next == nil {
			select {
			case <-c.wake:
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		err := stream.Send(next.req)
		c.mu.Lock()
		next.sent = true
		c.mu.Unlock()
		if err == nil {
			continue
		}
		// Send reports io.EOF when the stream broke; any other error is about
		// this request (too large, say): resent, it would break every new
		// stream, so it fails alone.
		if !errors.Is(err, io.EOF) && ctx.Err() == nil {
			if code := status.Code(err); code == codes.ResourceExhausted || code == codes.Internal {
				c.mu.Lock()
				c.finish(next, nil, fmt.Errorf("grader.Client.Grade %s: %w", next.req.GetRolloutId(), err))
				c.mu.Unlock()
			}
		}
		return err
	}
}
