package gateway

import (
	"context"
	"errors"
	"io"
	"net/http"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/genproto/googleapis/api/httpbody"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// restRolloutClient is the rollout client the REST mux uses. Its streams
// wait until the service accepted the request (StreamRows' response
// headers, else the first message or the end of the stream) before
// returning, so that a stream failing at once answers like every other
// REST call, not with an in-stream {"error": ...} line (which is how later
// failures are reported). grpc-gateway waits for the response headers
// anyway; WatchRollouts sends them with its first message.
type restRolloutClient struct {
	rolloutv1.RolloutServiceClient
}

func (c restRolloutClient) WatchRollouts(ctx context.Context, in *rolloutv1.WatchRolloutsRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[rolloutv1.Rollout], error) {
	stream, err := c.RolloutServiceClient.WatchRollouts(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	return prime(stream)
}

func (c restRolloutClient) StreamRows(ctx context.Context, in *rolloutv1.StreamRowsRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[rolloutv1.Row], error) {
	stream, err := c.RolloutServiceClient.StreamRows(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	// The service sends headers once it accepted the request; a stream
	// that ended without them failed (or was empty).
	if md, _ := stream.Header(); md != nil {
		return stream, nil
	}
	return prime(stream)
}

// prime receives the first message (or the end of the stream) and
// returns a stream that replays it, or the error that ended the stream.
func prime[T any](stream grpc.ServerStreamingClient[T]) (grpc.ServerStreamingClient[T], error) {
	first, err := stream.Recv()
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return &primedStream[T]{ServerStreamingClient: stream, first: first, firstErr: err}, nil
}

// primedStream replays the message (or io.EOF) already received.
type primedStream[T any] struct {
	grpc.ServerStreamingClient[T]
	first    *T
	firstErr error
	replayed bool
}

func (s *primedStream[T]) Recv() (*T, error) {
	if !s.replayed {
		s.replayed = true
		return s.first, s.firstErr
	}
	return s.ServerStreamingClient.Recv()
}

// rowsContentType is the REST rows stream's: one row, a JSON object, per
// line.
const rowsContentType = "application/x-ndjson"

// plainRows writes each row of the REST rows stream as the row itself,
// not grpc-gateway's {"result": row}: a trainer reads one JSON row per
// line. A failure after the first row is still an {"error": ...} line.
func plainRows(m runtime.Marshaler) runtime.ForwardResponseRewriter {
	return func(_ context.Context, resp proto.Message) (any, error) {
		row, ok := resp.(*rolloutv1.Row)
		if !ok {
			return resp, nil
		}
		b, err := m.Marshal(row)
		if err != nil {
			return nil, err
		}
		return &httpbody.HttpBody{ContentType: rowsContentType, Data: b}, nil
	}
}

// rowsHeaders answers a REST rows stream's headers as soon as the service
// accepted it (the option runs with no message before the first row), so
// a trainer waiting for rows of rollouts yet to finish knows it is
// connected.
func rowsHeaders(ctx context.Context, w http.ResponseWriter, resp proto.Message) error {
	if resp != nil {
		return nil
	}
	if method, ok := runtime.RPCMethod(ctx); !ok || method != rolloutv1.RolloutService_StreamRows_FullMethodName {
		return nil
	}
	w.Header().Set("Content-Type", rowsContentType)
	w.WriteHeader(http.StatusOK)
	// A writer that cannot flush sends the headers with the first row.
	if err := http.NewResponseController(w).Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	return nil
}

// headerOnce drops WriteHeader calls after the first: grpc-gateway answers
// a stream failing before its first message with a status of its own,
// which a rows stream already answered (see rowsHeaders); its error line
// follows.
type headerOnce struct {
	http.ResponseWriter
	wrote bool
}

func (w *headerOnce) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *headerOnce) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

func (w *headerOnce) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// rowsStreamPath is StreamRows' REST path.
const rowsStreamPath = "/v1/rows:stream"
