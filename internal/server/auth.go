package server

import (
	"context"
	"crypto/subtle"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// AuthMessage is the Osmosis 401 detail, verbatim.
const AuthMessage = "Invalid or missing API key"

// BearerAuth requires an API key, as a bearer token or bare, in the
// "authorization" metadata of every RPC but the public ones: the standard
// health service, reflection, and those named when it is made. A zero key
// lets everything through.
type BearerAuth struct {
	key    []byte
	public map[string]bool
}

// NewBearerAuth returns the check of key; public lists full method names
// that need no key besides health and reflection.
func NewBearerAuth(key string, public ...string) *BearerAuth {
	a := &BearerAuth{key: []byte(key), public: map[string]bool{
		"/grpc.health.v1.Health/Check": true,
		"/grpc.health.v1.Health/Watch": true,
		"/grpc.health.v1.Health/List":  true,
	}}
	for _, m := range public {
		a.public[m] = true
	}
	return a
}

// Authorize returns an Unauthenticated error unless ctx carries the key or
// method is public.
func (a *BearerAuth) Authorize(ctx context.Context, method string) error {
	if len(a.key) == 0 || a.public[method] || strings.HasPrefix(method, "/grpc.reflection.") {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	if a.Check(md.Get("authorization")) {
		return nil
	}
	return status.Error(codes.Unauthenticated, AuthMessage)
}

// Check reports whether one of the Authorization values carries the key,
// as a bearer token or bare; a zero key accepts anything.
func (a *BearerAuth) Check(values []string) bool {
	if len(a.key) == 0 {
		return true
	}
	for _, v := range values {
		token := v
		if len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
			token = strings.TrimSpace(v[7:])
		}
		if subtle.ConstantTimeCompare([]byte(token), a.key) == 1 {
			return true
		}
	}
	return false
}

// Unary enforces the key on unary RPCs.
func (a *BearerAuth) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := a.Authorize(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// Stream enforces the key on streaming RPCs.
func (a *BearerAuth) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := a.Authorize(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}

// BearerCredentials presents key on every call of a connection. The
// services talk plain gRPC inside a trusted network (or behind a mesh that
// encrypts) unless given TLS flags, so the credentials work over either and
// do not demand transport security.
type BearerCredentials string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (c BearerCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(c)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (BearerCredentials) RequireTransportSecurity() bool { return false }
