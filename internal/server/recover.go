package server

import (
	"context"
	"log/slog"
	"runtime/debug"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// RecoverUnary turns a handler panic into codes.Internal so one bad request
// never takes the process down.
func RecoverUnary(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer recoverTo(ctx, log, info.FullMethod, &err)
		return handler(ctx, req)
	}
}

// RecoverStream is RecoverUnary for streams.
func RecoverStream(log *slog.Logger) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer recoverTo(ss.Context(), log, info.FullMethod, &err)
		return handler(srv, ss)
	}
}

// recoverTo, deferred, turns a panic into an Internal error in *err.
func recoverTo(ctx context.Context, log *slog.Logger, method string, err *error) {
	if p := recover(); p != nil {
		log.ErrorContext(ctx, "panic in handler", "method", method, "panic", p, "stack", string(debug.Stack()))
		*err = status.Errorf(codes.Internal, "internal error in %s", method)
	}
}
