package gateway

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"

	"connectrpc.com/connect"
	"connectrpc.com/grpcreflect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/gen/osmo/grader/v1/graderv1connect"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/gen/osmo/rollout/v1/rolloutv1connect"
)

// newRPCRoutes builds the Connect handlers. Each one also speaks gRPC and
// gRPC-Web, so the gateway port takes all three.
func (g *gateway) newRPCRoutes(rollout, grader grpc.ClientConnInterface) []rpcRoute {
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(connectReadMaxBytes(g.maxBody)),
		connect.WithInterceptors(logInterceptor{log: g.log}),
	}
	var routes []rpcRoute
	add := func(prefix string, h http.Handler) {
		routes = append(routes, rpcRoute{prefix: prefix, handler: h})
	}

	add(rolloutv1connect.NewRolloutServiceHandler(
		rolloutForwarder{client: rolloutv1.NewRolloutServiceClient(rollout)}, opts...))
	add(graderv1connect.NewGraderServiceHandler(
		graderForwarder{client: graderv1.NewGraderServiceClient(grader)}, opts...))

	health := healthForwarder{
		rollout: grpc_health_v1.NewHealthClient(rollout),
		grader:  grpc_health_v1.NewHealthClient(grader),
	}
	check := connect.NewUnaryHandlerSimple(grpc_health_v1.Health_Check_FullMethodName, health.Check, opts...)
	add("/"+grpc_health_v1.Health_ServiceDesc.ServiceName+"/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Only Check is forwarded; a gRPC client reads the 404 as
		// Unimplemented.
		if r.URL.Path != grpc_health_v1.Health_Check_FullMethodName {
			http.NotFound(w, r)
			return
		}
		check.ServeHTTP(w, r)
	}))

	reflector := grpcreflect.NewStaticReflector(
		rolloutv1connect.RolloutServiceName,
		graderv1connect.GraderServiceName,
		grpc_health_v1.Health_ServiceDesc.ServiceName,
	)
	add(grpcreflect.NewHandlerV1(reflector, opts...))
	add(grpcreflect.NewHandlerV1Alpha(reflector, opts...))
	return routes
}

// rolloutForwarder implements the Connect rollout service by calling the
// gRPC one.
type rolloutForwarder struct {
	client rolloutv1.RolloutServiceClient
}

var _ rolloutv1connect.RolloutServiceHandler = rolloutForwarder{}

func (f rolloutForwarder) InitRollout(ctx context.Context, req *rolloutv1.InitRolloutRequest) (*rolloutv1.InitRolloutResponse, error) {
	return forwardUnary(ctx, req, f.client.InitRollout)
}

func (f rolloutForwarder) GetRollout(ctx context.Context, req *rolloutv1.GetRolloutRequest) (*rolloutv1.Rollout, error) {
	return forwardUnary(ctx, req, f.client.GetRollout)
}

func (f rolloutForwarder) StartRollout(ctx context.Context, req *rolloutv1.StartRolloutRequest) (*rolloutv1.StartRolloutResponse, error) {
	return forwardUnary(ctx, req, f.client.StartRollout)
}

func (f rolloutForwarder) GetRolloutStatus(ctx context.Context, req *rolloutv1.GetRolloutStatusRequest) (*rolloutv1.RolloutStatus, error) {
	return forwardUnary(ctx, req, f.client.GetRolloutStatus)
}

func (f rolloutForwarder) CancelRollouts(ctx context.Context, req *rolloutv1.CancelRolloutsRequest) (*rolloutv1.CancelRolloutsResponse, error) {
	return forwardUnary(ctx, req, f.client.CancelRollouts)
}

func (f rolloutForwarder) Health(ctx context.Context, req *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	return forwardUnary(ctx, req, f.client.Health)
}

func (f rolloutForwarder) PlatformHealth(ctx context.Context, req *rolloutv1.HealthRequest) (*rolloutv1.HealthResponse, error) {
	return forwardUnary(ctx, req, f.client.PlatformHealth)
}

func (f rolloutForwarder) WatchRollouts(ctx context.Context, req *rolloutv1.WatchRolloutsRequest, stream *connect.ServerStream[rolloutv1.Rollout]) error {
	// Cancelling on return releases the upstream stream if the client left.
	ctx, cancel := context.WithCancel(outgoingContext(ctx))
	defer cancel()
	upstream, err := f.client.WatchRollouts(ctx, req)
	if err != nil {
		return connectError(err)
	}
	for {
		rollout, err := upstream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return connectError(err)
		}
		if err := stream.Send(rollout); err != nil {
			return err
		}
	}
}

// graderForwarder implements the Connect grader service by calling the gRPC
// one.
type graderForwarder struct {
	client graderv1.GraderServiceClient
}

var _ graderv1connect.GraderServiceHandler = graderForwarder{}

func (f graderForwarder) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	return forwardUnary(ctx, req, f.client.Grade)
}

// GradeStream pumps requests to the grader in a goroutine and responses back
// in this one. The call ends when the grader ends its side: a client that
// is still sending then sees the grader's status, and the pump unblocks when
// connect closes the request body after this returns.
func (f graderForwarder) GradeStream(ctx context.Context, stream *connect.BidiStream[graderv1.GradeRequest, graderv1.GradeResponse]) error {
	ctx, cancel := context.WithCancel(outgoingContext(ctx))
	defer cancel()
	upstream, err := f.client.GradeStream(ctx)
	if err != nil {
		return connectError(err)
	}

	// Buffered: the pump never blocks on reporting, even if nobody reads.
	pumpErr := make(chan error, 1)
	go func() {
		err := pumpRequests(stream, upstream)
		if err != nil {
			// Stop the grader too: its half of the call cannot complete.
			cancel()
		}
		pumpErr <- err
	}()

	for {
		resp, err := upstream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			// If the client's side failed first, that is the real cause;
			// the grader only saw the cancellation.
			select {
			case perr := <-pumpErr:
				if perr != nil {
					return perr
				}
			default:
			}
			return connectError(err)
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

// pumpRequests copies client requests to the grader until the client closes
// its side (then it half-closes the grader's) or something fails.
func pumpRequests(stream *connect.BidiStream[graderv1.GradeRequest, graderv1.GradeResponse], upstream grpc.BidiStreamingClient[graderv1.GradeRequest, graderv1.GradeResponse]) error {
	for {
		req, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			// CloseSend never fails in grpc-go; the grader's answer arrives
			// through Recv.
			_ = upstream.CloseSend()
			return nil
		}
		if err != nil {
			return err
		}
		if err := upstream.Send(req); err != nil {
			// io.EOF means the grader already ended the call; Recv reports
			// its status.
			if errors.Is(err, io.EOF) {
				return nil
			}
			return connectError(err)
		}
	}
}

// healthForwarder answers grpc.health.v1.Health/Check from the rollout
// service's health service, or the grader's when asked about the grader.
type healthForwarder struct {
	rollout, grader grpc_health_v1.HealthClient
}

func (h healthForwarder) Check(ctx context.Context, req *grpc_health_v1.HealthCheckRequest) (*grpc_health_v1.HealthCheckResponse, error) {
	client := h.rollout
	if req.GetService() == graderv1connect.GraderServiceName {
		client = h.grader
	}
	return forwardUnary(ctx, req, client.Check)
}

// forwardUnary makes one gRPC call with the request's allowed headers and
// turns its status into a Connect error.
func forwardUnary[Req, Resp any](ctx context.Context, req *Req, call func(context.Context, *Req, ...grpc.CallOption) (*Resp, error)) (*Resp, error) {
	resp, err := call(outgoingContext(ctx), req)
	if err != nil {
		return nil, connectError(err)
	}
	return resp, nil
}

// connectError converts a gRPC error into a Connect error with the same code,
// message and details. Connect codes are numerically the gRPC codes.
func connectError(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		st = status.FromContextError(err)
	}
	cerr := connect.NewError(connect.Code(st.Code()), errors.New(st.Message()))
	for _, d := range st.Proto().GetDetails() {
		if detail, derr := connect.NewErrorDetail(d); derr == nil {
			cerr.AddDetail(detail)
		}
	}
	return cerr
}

// unavailableConn stands in for a service that is not deployed behind the
// gateway: every call fails with Unavailable.
type unavailableConn struct {
	service string
}

func (c unavailableConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return c.err()
}

func (c unavailableConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, c.err()
}

func (c unavailableConn) err() error {
	return status.Errorf(codes.Unavailable, "%s service is not configured on this gateway", c.service)
}

// logInterceptor logs failed Connect, gRPC and gRPC-Web calls.
type logInterceptor struct {
	log *slog.Logger
}

func (i logInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		if err != nil {
			i.failed(ctx, req.Spec().Procedure, req.Header(), err)
		}
		return resp, err
	}
}

func (i logInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i logInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		err := next(ctx, conn)
		if err != nil {
			i.failed(ctx, conn.Spec().Procedure, conn.RequestHeader(), err)
		}
		return err
	}
}

func (i logInterceptor) failed(ctx context.Context, procedure string, h http.Header, err error) {
	code := codes.Code(connect.CodeOf(err))
	attrs := append(requestAttrs(h),
		slog.String("rpc", procedure),
		slog.String("code", code.String()),
		slog.String("error", err.Error()),
	)
	i.log.LogAttrs(ctx, levelForStatus(httpStatusFromCode(code)), "gateway: RPC failed", attrs...)
}
