package gateway

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// restRolloutClient is the rollout client the REST mux uses. Its
// WatchRollouts waits for the first rollout (or the end of the stream)
// before returning, so that a watch failing at once answers like every
// other REST call, not with an in-stream {"error": ...} line (which is how
// later failures are reported). grpc-gateway waits for the response
// headers anyway, which come with the first message.
type restRolloutClient struct {
	rolloutv1.RolloutServiceClient
}

func (c restRolloutClient) WatchRollouts(ctx context.Context, in *rolloutv1.WatchRolloutsRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[rolloutv1.Rollout], error) {
	stream, err := c.RolloutServiceClient.WatchRollouts(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	first, err := stream.Recv()
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return &primedStream{ServerStreamingClient: stream, first: first, firstErr: err}, nil
}

// primedStream replays the message (or io.EOF) already received.
type primedStream struct {
	grpc.ServerStreamingClient[rolloutv1.Rollout]
	first    *rolloutv1.Rollout
	firstErr error
	replayed bool
}

func (s *primedStream) Recv() (*rolloutv1.Rollout, error) {
	if !s.replayed {
		s.replayed = true
		return s.first, s.firstErr
	}
	return s.ServerStreamingClient.Recv()
}
