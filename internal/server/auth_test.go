package server_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo/internal/server"
)

func TestBearerAuth(t *testing.T) {
	const method = "/osmo.grader.v1.GraderService/Grade"
	auth := server.NewBearerAuth("K", "/svc/Public")
	tests := []struct {
		name   string
		key    *server.BearerAuth
		method string
		header []string
		ok     bool
	}{
		{"bearer", auth, method, []string{"Bearer K"}, true},
		{"bearer any case", auth, method, []string{"bearer K"}, true},
		{"bare token", auth, method, []string{"K"}, true},
		{"one of several", auth, method, []string{"Bearer nope", "Bearer K"}, true},
		{"wrong key", auth, method, []string{"Bearer KK"}, false},
		{"prefix of the key", auth, method, []string{"Bearer "}, false},
		{"none", auth, method, nil, false},
		{"public method", auth, "/svc/Public", nil, true},
		{"health", auth, "/grpc.health.v1.Health/Check", nil, true},
		{"reflection", auth, "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", nil, true},
		{"no key configured", server.NewBearerAuth(""), method, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			if tc.header != nil {
				md := metadata.MD{}
				md.Append("authorization", tc.header...)
				ctx = metadata.NewIncomingContext(ctx, md)
			}
			err := tc.key.Authorize(ctx, tc.method)
			if tc.ok && err != nil {
				t.Errorf("Authorize = %v, want nil", err)
			}
			if !tc.ok && (status.Code(err) != codes.Unauthenticated || status.Convert(err).Message() != server.AuthMessage) {
				t.Errorf("Authorize = %v, want Unauthenticated %q", err, server.AuthMessage)
			}
		})
	}
}

func TestBearerCredentials(t *testing.T) {
	md, err := server.BearerCredentials("K").GetRequestMetadata(context.Background())
	if err != nil || md["authorization"] != "Bearer K" {
		t.Errorf("metadata %v %v", md, err)
	}
	if server.BearerCredentials("K").RequireTransportSecurity() {
		t.Error("the services talk plain gRPC inside the deployment; credentials must not demand TLS")
	}
}
