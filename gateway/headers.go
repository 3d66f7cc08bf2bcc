package gateway

import (
	"context"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/grpc/metadata"
)

// isForwarded reports whether a request header (lower-case name) is passed
// to the services as gRPC metadata: an explicit list, so cookies and proxy
// headers never reach them.
func isForwarded(name string) bool {
	switch name {
	case "authorization",
		"x-rollout-id", "x-sample-id", "x-request-id",
		"traceparent", "tracestate", "baggage",
		"idempotency-key":
		return true
	default:
		return false
	}
}

// incomingHeader is the grpc-gateway header matcher; grpc-gateway forwards
// Authorization by itself.
func incomingHeader(key string) (string, bool) {
	name := strings.ToLower(key)
	if name == "authorization" {
		return "", false
	}
	return name, isForwarded(name)
}

// dropHeader keeps service metadata out of REST responses.
func dropHeader(string) (string, bool) { return "", false }

// outgoingContext carries the allowed headers of a Connect, gRPC or gRPC-Web
// request into the metadata of the call to the service.
func outgoingContext(ctx context.Context) context.Context {
	info, ok := connect.CallInfoForHandlerContext(ctx)
	if !ok {
		return ctx
	}
	md := forwardedMetadata(info.RequestHeader())
	if len(md) == 0 {
		return ctx
	}
	return metadata.NewOutgoingContext(ctx, md)
}

func forwardedMetadata(h http.Header) metadata.MD {
	md := metadata.MD{}
	for key, values := range h {
		name := strings.ToLower(key)
		if !isForwarded(name) {
			continue
		}
		for _, v := range values {
			// Anything but printable ASCII would fail the whole call.
			if isMetadataText(v) {
				md.Append(name, v)
			}
		}
	}
	return md
}

func isMetadataText(v string) bool {
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return true
}
