package inproc

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// Conn is a grpc.ClientConnInterface that calls the unary methods of one
// service in the same process, as a gRPC server would call them (the
// server's unary interceptors around the handler, the client's outgoing
// metadata as the incoming metadata, the caller's context with its
// deadline, trace and cancellation), without encoding anything: the
// handler is given the caller's request message itself. Streaming calls,
// and methods of other services, go to Fallback.
//
// The caller must not change a request once it is sent (the handler may
// keep it, as it would keep the one a server decoded for it); the reply is
// copied into the caller's message, as a client decodes it.
//
// Call options (grpc.Header and the like) are not applied: no header or
// trailer is received in process.
type Conn struct {
	srv     any
	methods map[string]grpc.MethodDesc
	chain   grpc.UnaryServerInterceptor
	// Fallback serves what Conn does not: streams, other services.
	Fallback grpc.ClientConnInterface
}

// NewConn is a Conn calling impl, the implementation of the service desc
// describes (as given to grpc.Server.RegisterService), through
// interceptors, the first outermost, as grpc.ChainUnaryInterceptor orders
// them.
func NewConn(desc *grpc.ServiceDesc, impl any, fallback grpc.ClientConnInterface, interceptors ...grpc.UnaryServerInterceptor) *Conn {
	c := &Conn{srv: impl, methods: map[string]grpc.MethodDesc{}, Fallback: fallback}
	for _, m := range desc.Methods {
		c.methods["/"+desc.ServiceName+"/"+m.MethodName] = m
	}
	c.chain = chain(interceptors)
	return c
}

func chain(ics []grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		next := handler
		for i := len(ics) - 1; i >= 0; i-- {
			ic, inner := ics[i], next
			next = func(ctx context.Context, req any) (any, error) { return ic(ctx, req, info, inner) }
		}
		return next(ctx, req)
	}
}

// Invoke calls method with args and sets reply to its answer.
func (c *Conn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	m, ok := c.methods[method]
	if !ok {
		if c.Fallback == nil {
			return fmt.Errorf("inproc: no method %s", method)
		}
		return c.Fallback.Invoke(ctx, method, args, reply, opts...)
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	ctx = metadata.NewIncomingContext(ctx, toIncoming(md))
	// The generated handler decodes into a message of its own and passes
	// that to the interceptor; the caller's message goes in its place.
	noDecode := func(any) error { return nil }
	intercept := func(ctx context.Context, _ any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		return c.chain(ctx, args, info, handler)
	}
	resp, err := m.Handler(c.srv, ctx, noDecode, intercept)
	if err != nil {
		return err
	}
	out, ok1 := reply.(proto.Message)
	in, ok2 := resp.(proto.Message)
	if !ok1 || !ok2 {
		return fmt.Errorf("inproc: %s: answer %T, reply %T: not protobuf messages", method, resp, reply)
	}
	proto.Reset(out)
	proto.Merge(out, in)
	return nil
}

// NewStream is the Fallback's.
func (c *Conn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if c.Fallback == nil {
		return nil, fmt.Errorf("inproc: no stream %s", method)
	}
	return c.Fallback.NewStream(ctx, desc, method, opts...)
}

// toIncoming is outgoing metadata as a server receives it: keys in lower
// case (a client may set them in any case; HTTP/2 carries them lowered).
func toIncoming(md metadata.MD) metadata.MD {
	out := make(metadata.MD, len(md))
	for k, v := range md {
		k = strings.ToLower(k)
		out[k] = append(out[k], v...)
	}
	return out
}
