package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"slices"

	"connectrpc.com/connect"
	"connectrpc.com/grpcreflect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/gen/osmo/grader/v1/graderv1connect"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/gen/osmo/rollout/v1/rolloutv1connect"
)

// newRPCRoutes builds a Connect handler (gRPC and gRPC-Web too) for every
// method of the rollout and grader services and for
// grpc.health.v1.Health/Check, each forwarding by the method's descriptor.
func (g *gateway) newRPCRoutes(rollout, grader grpc.ClientConnInterface) ([]rpcRoute, error) {
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(int(min(g.maxBody, math.MaxInt))),
		connect.WithInterceptors(logInterceptor{log: g.log}),
	}
	var routes []rpcRoute
	for _, svc := range []struct {
		desc protoreflect.ServiceDescriptor
		conn grpc.ClientConnInterface
	}{
		{rolloutv1.File_osmo_rollout_v1_rollout_proto.Services().ByName("RolloutService"), rollout},
		{graderv1.File_osmo_grader_v1_grader_proto.Services().ByName("GraderService"), grader},
	} {
		mux := http.NewServeMux()
		methods := svc.desc.Methods()
		for i := range methods.Len() {
			h, err := forwarder(methods.Get(i), svc.conn, opts)
			if err != nil {
				return nil, err
			}
			mux.Handle(h.procedure, h)
		}
		routes = append(routes, rpcRoute{prefix: "/" + string(svc.desc.FullName()) + "/", handler: mux})
	}

	// Health's methods but Check are 404 (Unimplemented).
	check, err := forwarder(grpc_health_v1.File_grpc_health_v1_health_proto.Services().Get(0).Methods().ByName("Check"), healthConn{rollout, grader}, opts)
	if err != nil {
		return nil, err
	}
	health := http.NewServeMux()
	health.Handle(check.procedure, check)
	routes = append(routes, rpcRoute{prefix: "/" + grpc_health_v1.Health_ServiceDesc.ServiceName + "/", handler: health})

	reflector := grpcreflect.NewStaticReflector(
		rolloutv1connect.RolloutServiceName,
		graderv1connect.GraderServiceName,
		grpc_health_v1.Health_ServiceDesc.ServiceName,
	)
	prefix, handler := grpcreflect.NewHandlerV1(reflector, opts...)
	routes = append(routes, rpcRoute{prefix, handler})
	prefix, handler = grpcreflect.NewHandlerV1Alpha(reflector, opts...)
	return append(routes, rpcRoute{prefix, handler}), nil
}

// message is a request or response of any method, made before connect
// decodes into it; it is a proto.Message, which connect's codecs take.
type message struct {
	proto.Message
}

// forwarding is the Connect handler of one procedure and where it calls.
type forwarding struct {
	http.Handler
	procedure string
	conn      grpc.ClientConnInterface
	in        protoreflect.MessageType
	out       protoreflect.MessageType
}

// healthConn asks the grader about the grader service's health, the
// rollout service about everything else.
type healthConn struct {
	grpc.ClientConnInterface // the rollout service
	grader                   grpc.ClientConnInterface
}

func (c healthConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	if args.(*grpc_health_v1.HealthCheckRequest).GetService() == graderv1connect.GraderServiceName {
		return c.grader.Invoke(ctx, method, args, reply, opts...)
	}
	return c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
}

// forwarder is the Connect handler that calls method on conn.
func forwarder(method protoreflect.MethodDescriptor, conn grpc.ClientConnInterface, opts []connect.HandlerOption) (*forwarding, error) {
	f := &forwarding{procedure: "/" + string(method.Parent().FullName()) + "/" + string(method.Name()), conn: conn}
	var err error
	if f.in, err = protoregistry.GlobalTypes.FindMessageByName(method.Input().FullName()); err != nil {
		return nil, fmt.Errorf("gateway.New: %s: %w", f.procedure, err)
	}
	if f.out, err = protoregistry.GlobalTypes.FindMessageByName(method.Output().FullName()); err != nil {
		return nil, fmt.Errorf("gateway.New: %s: %w", f.procedure, err)
	}
	opts = append(slices.Clip(opts), connect.WithSchema(method), connect.WithRequestInitializer(func(_ connect.Spec, m any) error {
		m.(*message).Message = f.in.New().Interface()
		return nil
	}))
	switch {
	case !method.IsStreamingClient() && !method.IsStreamingServer():
		f.Handler = connect.NewUnaryHandler(f.procedure, f.unary, opts...)
	case !method.IsStreamingClient():
		f.Handler = connect.NewServerStreamHandler(f.procedure, f.serverStream, opts...)
	default:
		f.Handler = connect.NewBidiStreamHandler(f.procedure, f.bidiStream, opts...)
	}
	return f, nil
}

func (f *forwarding) unary(ctx context.Context, req *connect.Request[message]) (*connect.Response[message], error) {
	reply := f.out.New().Interface()
	if err := f.conn.Invoke(outgoingContext(ctx), f.procedure, req.Msg.Message, reply); err != nil {
		return nil, connectError(err)
	}
	return connect.NewResponse(&message{reply}), nil
}

func (f *forwarding) serverStream(ctx context.Context, req *connect.Request[message], stream *connect.ServerStream[message]) error {
	ctx, cancel := context.WithCancel(outgoingContext(ctx))
	defer cancel()
	upstream, err := f.conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, f.procedure)
	if err != nil {
		return connectError(err)
	}
	if err := upstream.SendMsg(req.Msg.Message); err != nil && !errors.Is(err, io.EOF) {
		return connectError(err)
	}
	if err := upstream.CloseSend(); err != nil {
		return connectError(err)
	}
	return f.reply(upstream, stream.Send, nil)
}

// bidiStream pumps requests to the service in a goroutine and replies in
// this one, until the service ends its side.
func (f *forwarding) bidiStream(ctx context.Context, stream *connect.BidiStream[message, message]) error {
	ctx, cancel := context.WithCancel(outgoingContext(ctx))
	defer cancel()
	upstream, err := f.conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, f.procedure)
	if err != nil {
		return connectError(err)
	}
	pumpErr := make(chan error, 1)
	go func() {
		err := pumpRequests(stream, upstream)
		if err != nil {
			cancel()
		}
		pumpErr <- err
	}()
	return f.reply(upstream, stream.Send, pumpErr)
}

// reply sends the service's replies to the client until the service ends
// the call; a failure of the client's side (pumpErr) is the real cause.
func (f *forwarding) reply(upstream grpc.ClientStream, send func(*message) error, pumpErr <-chan error) error {
	for {
		reply := f.out.New().Interface()
		err := upstream.RecvMsg(reply)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			select {
			case perr := <-pumpErr:
				if perr != nil {
					return perr
				}
			default:
			}
			return connectError(err)
		}
		if err := send(&message{reply}); err != nil {
			return err
		}
	}
}

// pumpRequests copies client requests to the service until the client
// closes its side or something fails.
func pumpRequests(stream *connect.BidiStream[message, message], upstream grpc.ClientStream) error {
	for {
		req, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			_ = upstream.CloseSend()
			return nil
		}
		if err != nil {
			return err
		}
		if err := upstream.SendMsg(req.Message); err != nil {
			// The service ended the call; RecvMsg reports its status.
			if errors.Is(err, io.EOF) {
				return nil
			}
			return connectError(err)
		}
	}
}

// connectError converts a gRPC error into a Connect error (the codes are
// the same numbers) with its details.
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

// unavailableConn stands in for the grader service when it is not deployed
// behind the gateway: every call fails with Unavailable.
type unavailableConn struct{}

func (c unavailableConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return c.err()
}

func (c unavailableConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, c.err()
}

func (c unavailableConn) err() error {
	return status.Error(codes.Unavailable, "grader service is not configured on this gateway")
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
