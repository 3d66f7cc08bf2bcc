package natsstore_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/natsstore"
)

// BenchmarkLifecycleWrites measures what the embedded store sustains under
// each storage and sync setting, as a rollout uses it: one op is a
// lifecycle created, then updated four times under compare-and-set (about
// what osmo_state_writes_total counts per rollout), with many rollouts
// written at once. Compare within one run:
//
//	go test -run '^$' -bench LifecycleWrites ./internal/natsstore/
func BenchmarkLifecycleWrites(b *testing.B) {
	value := make([]byte, 1500) // a G2 request with a short prompt
	for _, bc := range []struct {
		name string
		cfg  func(b *testing.B) natsstore.Config
	}{
		{"memory", func(*testing.B) natsstore.Config { return natsstore.Config{} }},
		{"file-sync-2m", func(b *testing.B) natsstore.Config { return natsstore.Config{Dir: b.TempDir()} }},
		{"file-sync-always", func(b *testing.B) natsstore.Config {
			return natsstore.Config{Dir: b.TempDir(), Sync: natsstore.SyncAlways}
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			ctx := context.Background()
			st, err := natsstore.Open(ctx, bc.cfg(b))
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			kv, err := st.KeyValue(ctx, jetstream.KeyValueConfig{Bucket: "bench", History: 1})
			if err != nil {
				b.Fatal(err)
			}
			var n atomic.Int64
			b.SetParallelism(100) // rollouts written at once, per core
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := natsstore.Key(fmt.Sprintf("r-%d", n.Add(1)))
					rev, err := kv.Create(ctx, key, value)
					for i := 0; err == nil && i < 4; i++ {
						rev, err = kv.Update(ctx, key, value, rev)
					}
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "rollouts/s")
		})
	}
}
