package grader

import (
	"context"
	"hash/fnv"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
)

// Pool spreads gradings over several GradeStreams on one connection: with
// round_robin to a headless Service, each lands on another grader replica.
// A rollout always goes to the same stream (by a hash of its id), so its
// resends stay with the Client that holds them.
type Pool struct {
	clients []*Client
}

// NewPool returns a Pool of n Clients (n < 1 means 1) over conn.
func NewPool(conn grpc.ClientConnInterface, n int, opts ClientOptions) *Pool {
	n = max(n, 1)
	p := &Pool{clients: make([]*Client, n)}
	for i := range p.clients {
		p.clients[i] = NewClient(conn, opts)
	}
	return p
}

// Run keeps every stream open until ctx ends.
func (p *Pool) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, c := range p.clients {
		g.Go(func() error { return c.Run(ctx) })
	}
	return g.Wait()
}

// Grade sends req on its rollout's stream and waits for the answer.
func (p *Pool) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	h := fnv.New32a()
	_, _ = h.Write([]byte(req.GetRolloutId()))
	return p.clients[int(h.Sum32()%uint32(len(p.clients)))].Grade(ctx, req)
}
