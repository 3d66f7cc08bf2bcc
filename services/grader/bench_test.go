package grader_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/services/grader"
)

// BenchmarkClientGrade measures a grading round trip over the Client's one
// stream, with callers in parallel, with the gradings in memory and on disk
// (the embedded NATS server's file storage).
func BenchmarkClientGrade(b *testing.B) {
	for _, onDisk := range []bool{false, true} {
		b.Run(fmt.Sprintf("disk=%v", onDisk), func(b *testing.B) {
			dir := ""
			if onDisk {
				dir = b.TempDir()
			}
			cfg := grader.Config{Graders: map[string]osmo.Grader{"g": newCounter(nil)}, Default: "g", State: openState(b, dir)}
			ts := startServer(b, "127.0.0.1:0", cfg)
			client := grader.NewClient(dial(b, ts.addr), grader.ClientOptions{Logger: quietLogger()})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = client.Run(ctx) }()
			b.Cleanup(func() { cancel(); <-done })
			req := gradeReq(b, "r", "x", "a")
			var seq atomic.Int64
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r := proto.Clone(req).(*graderv1.GradeRequest)
					r.RolloutId = fmt.Sprintf("%s-r%d", b.Name(), seq.Add(1))
					for _, s := range r.Samples {
						s.RolloutId = r.RolloutId
					}
					resp, err := client.Grade(ctx, r)
					if err != nil || resp.GetError() != "" {
						b.Errorf("%v %v", resp, err)
						return
					}
				}
			})
		})
	}
}
