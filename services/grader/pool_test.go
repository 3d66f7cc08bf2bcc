package grader_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/services/grader"
)

// TestPoolSpreadsOverReplicas runs three grader replicas behind one
// round_robin connection and checks that a Pool's streams reach all of them
// while every rollout is graded exactly once.
func TestPoolSpreadsOverReplicas(t *testing.T) {
	const replicas = 3
	var total atomic.Int32
	perReplica := make([]atomic.Int32, replicas)
	warm := make([]atomic.Int32, replicas)
	addrs := make([]resolver.Address, replicas)
	state := openState(t, "") // one store, as replicas share
	for i := range replicas {
		svc, err := grader.New(testContext(t), grader.Config{
			Graders: map[string]osmo.Grader{"warm": osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
				warm[i].Add(1)
				return gc.RemoveSample("s")
			}), "one": osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
				total.Add(1)
				perReplica[i].Add(1)
				for id := range gc.Samples {
					if err := gc.SetSampleReward(id, 1); err != nil {
						return err
					}
				}
				return nil
			})},
			Default: "one",
			State:   state,
			Logger:  quietLogger(),
		})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := grpc.NewServer()
		graderv1.RegisterGraderServiceServer(srv, svc)
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { srv.Stop(); _ = svc.Close() })
		addrs[i] = resolver.Address{Addr: ln.Addr().String()}
	}
	r := manual.NewBuilderWithScheme("pooltest")
	r.InitialState(resolver.State{Addresses: addrs})
	conn, err := grpc.NewClient(r.Scheme()+":///graders",
		grpc.WithResolvers(r),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// round_robin only picks READY subchannels: wait until unary calls have
	// reached every replica, as they would have long before a real stack
	// opens its grading streams.
	stub := graderv1.NewGraderServiceClient(conn)
	for n := 0; warm[0].Load() == 0 || warm[1].Load() == 0 || warm[2].Load() == 0; n++ {
		if ctx.Err() != nil {
			t.Fatal("replicas never all became reachable")
		}
		id := fmt.Sprintf("warm-%d", n)
		if _, err := stub.Grade(ctx, &graderv1.GradeRequest{RolloutId: id, Grader: "warm", Label: proto.String("x"),
			Samples: []*rolloutv1.RolloutSample{{RolloutId: id, Id: "s"}}}); err != nil {
			t.Fatal(err)
		}
	}
	pool := grader.NewPool(conn, 6, grader.ClientOptions{Logger: quietLogger()})
	runDone := make(chan error, 1)
	runCtx, stopRun := context.WithCancel(ctx)
	go func() { runDone <- pool.Run(runCtx) }()
	t.Cleanup(func() { stopRun(); <-runDone })

	const rollouts = 60
	var wg sync.WaitGroup
	for i := range rollouts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("r-%d", i)
			resp, err := pool.Grade(ctx, &graderv1.GradeRequest{
				RolloutId: id,
				Label:     proto.String("x"),
				Samples:   []*rolloutv1.RolloutSample{{RolloutId: id, Id: "s"}},
			})
			if err != nil || resp.GetError() != "" || resp.GetGrades()[0].GetReward() != 1 {
				t.Errorf("%s: %v %v", id, resp, err)
			}
		}()
	}
	wg.Wait()
	if total.Load() != rollouts {
		t.Fatalf("graded %d times, want %d", total.Load(), rollouts)
	}
	for i := range replicas {
		if perReplica[i].Load() == 0 {
			t.Errorf("replica %d graded nothing: %v", i, []int32{perReplica[0].Load(), perReplica[1].Load(), perReplica[2].Load()})
		}
	}
}
