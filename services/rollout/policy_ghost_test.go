package rollout_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/services/rollout"
)

// TestPauseDoesNotWaitForAKilledReplica: a replica killed just before a
// pause leaves a fresh acknowledgement behind and never writes another.
// The pause stops waiting for it once it has been silent for three
// heartbeats, as for a replica silent before the pause began, rather than
// running into the acknowledgement timeout.
func TestPauseDoesNotWaitForAKilledReplica(t *testing.T) {
	url := sharedNATS(t)
	const heartbeat = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{URLs: []string{url}, Name: "replica-a", Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.State, c.ReplicaName = st, "replica-a"
		c.Policy.Heartbeat = heartbeat
		c.Policy.AckTimeout = 5 * time.Second
	}})
	waitFor(t, "the replica to acknowledge the policy state", func() bool {
		st, err := h.client.GetPolicy(ctx, &rolloutv1.GetPolicyRequest{})
		return err == nil && len(st.GetReplicas()) == 1
	})

	// The killed replica's last acknowledgement, written just now.
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, "osmo_policy")
	if err != nil {
		t.Fatal(err)
	}
	ghost, _ := json.Marshal(map[string]any{"replica": "ghost", "epoch": 0, "seen": time.Now().UTC()})
	if _, err := kv.Put(ctx, "ack."+natsstore.Key("ghost"), ghost); err != nil {
		t.Fatal(err)
	}

	t0 := time.Now()
	if _, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "keep"}); err != nil {
		t.Fatalf("PausePolicy: %v", err)
	}
	if d := time.Since(t0); d > 20*heartbeat {
		t.Errorf("the pause answered after %s, waiting for a replica silent for three heartbeats (%s)", d, 3*heartbeat)
	}
}
