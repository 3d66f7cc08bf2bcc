package inproc_test

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo/internal/inproc"
)

type ctxKey struct{}

// A unary call through Conn reaches the service through its interceptors,
// in order, with the caller's metadata as incoming metadata and the
// caller's context; the answer is the service's, copied; a refusal is the
// interceptor's status; a stream goes to the fallback.
func TestConnCallsTheServiceInProcess(t *testing.T) {
	hs := health.NewServer()
	hs.SetServingStatus("osmo", healthpb.HealthCheckResponse_SERVING)
	var order []string
	var sawAuth, sawValue any
	record := func(name string) grpc.UnaryServerInterceptor {
		return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			order = append(order, name+" "+info.FullMethod)
			return handler(ctx, req)
		}
	}
	auth := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		sawAuth, sawValue = md.Get("authorization"), ctx.Value(ctxKey{})
		if len(md.Get("authorization")) == 0 {
			return nil, status.Error(codes.Unauthenticated, "no key")
		}
		if req.(*healthpb.HealthCheckRequest).GetService() == "" {
			return nil, status.Error(codes.InvalidArgument, "service: required")
		}
		return handler(ctx, req)
	}
	conn := inproc.NewConn(&healthpb.Health_ServiceDesc, hs, nil, record("outer"), auth, record("inner"))
	client := healthpb.NewHealthClient(conn)

	ctx := context.WithValue(context.Background(), ctxKey{}, "trace")
	ctx = metadata.AppendToOutgoingContext(ctx, "Authorization", "Bearer k")
	resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: "osmo"})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check = %v, %v", resp, err)
	}
	if want := []string{"outer /grpc.health.v1.Health/Check", "inner /grpc.health.v1.Health/Check"}; len(order) != 2 || order[0] != want[0] || order[1] != want[1] {
		t.Errorf("interceptors ran %v, want %v", order, want)
	}
	if a, ok := sawAuth.([]string); !ok || len(a) != 1 || a[0] != "Bearer k" || sawValue != "trace" {
		t.Errorf("the service saw authorization %v and context value %v", sawAuth, sawValue)
	}
	// The answer is a copy: the service's own message is not the caller's.
	hs.SetServingStatus("osmo", healthpb.HealthCheckResponse_NOT_SERVING)
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Error("the caller's answer changed with the service's state")
	}

	if _, err := client.Check(metadata.AppendToOutgoingContext(context.Background(), "authorization", "k"), &healthpb.HealthCheckRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("invalid request: %v, want InvalidArgument", err)
	}
	if _, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "osmo"}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("no key: %v, want Unauthenticated", err)
	}
	if _, err := hs.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "unknown"}); status.Code(err) != codes.NotFound {
		t.Fatalf("health server: %v", err)
	}
	if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: "unknown"}); status.Code(err) != codes.NotFound {
		t.Errorf("the service's own error: %v, want NotFound", err)
	}
	if _, err := client.Watch(ctx, &healthpb.HealthCheckRequest{Service: "osmo"}); err == nil || errors.Is(err, context.Canceled) {
		t.Errorf("a stream with no fallback: %v, want an error", err)
	}
}
