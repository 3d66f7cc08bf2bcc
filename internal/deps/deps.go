// Package deps pins dependencies while packages that use them are written.
package deps

import (
	_ "connectrpc.com/connect"
	_ "connectrpc.com/grpcreflect"
	_ "github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	_ "golang.org/x/sync/errgroup"
	_ "golang.org/x/sync/singleflight"
	_ "google.golang.org/genproto/googleapis/api/annotations"
	_ "google.golang.org/grpc"
	_ "google.golang.org/grpc/health"
	_ "google.golang.org/grpc/reflection"
	_ "google.golang.org/protobuf/proto"
)
