package rollout_test

import (
	"context"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/services/rollout"
)

// sharedNATS starts a NATS server with JetStream on a loopback port of its
// own and returns its URL; it stops with the test.
func sharedNATS(t *testing.T) string {
	t.Helper()
	srv, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS did not start in 10s")
	}
	return srv.ClientURL()
}

// replicaOn runs a rollout service named name on the NATS at url, sharing
// the policy and trainers of share when set.
func replicaOn(t *testing.T, url, name string, share *harness) *harness {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{URLs: []string{url}, Name: name, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return newHarness(t, harnessOpts{share: share, cfg: func(c *rollout.Config) {
		c.State, c.ReplicaName = st, name
	}})
}

// TestStreamRowsAcrossReplicas: a client reading rows from one replica,
// which stops mid-stream, resumes on another with its last cursor and gets
// every row once, those of rollouts finished while it was away included.
func TestStreamRowsAcrossReplicas(t *testing.T) {
	url := sharedNATS(t)
	a := replicaOn(t, url, "replica-a", nil)
	b := replicaOn(t, url, "replica-b", a)

	a.runTokenRollout(t, "rep-1", 2, 3)
	b.runTokenRollout(t, "rep-2", 4, 5)
	held := rowsOf(t, b.client, "rep-1", "rep-2")
	if len(held) < 3 {
		t.Fatalf("only %d rows", len(held))
	}

	// Part of what is held, from replica a, up to a cursor inside a
	// rollout's rows; then the client is cut off and a stops, ending the
	// streams it still serves.
	s := openRows(t, a.client, "")
	got := s.next(t, len(held)-1)
	s.cancel()
	idle := openRows(t, a.client, "now")
	stopped := time.Now()
	a.stop(t)
	if took := time.Since(stopped); took > 10*time.Second {
		t.Errorf("replica a took %s to stop with a rows stream open", took)
	}
	if row, err := idle.recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("the stream of a stopped replica gave %v, %v; want Unavailable", row, err)
	}

	// Finished while the client is away, then resumed on b.
	b.runTokenRollout(t, "rep-3", 6, 7)
	s = openRows(t, b.client, got[len(got)-1].GetCursor())
	away := rowsOf(t, b.client, "rep-3")
	got = append(got, s.next(t, 1+len(away))...)
	b.runTokenRollout(t, "rep-4", 8, 9)
	later := rowsOf(t, b.client, "rep-4")
	got = append(got, s.next(t, len(later))...)

	want := append(append(held, away...), later...)
	if keys(got) != keys(want) {
		t.Errorf("rows across the switch:\n got %s\nwant %s", keys(got), keys(want))
	}
	seen := map[string]bool{}
	for _, row := range got {
		if seen[row.GetCursor()] {
			t.Errorf("cursor %s sent twice", row.GetCursor())
		}
		seen[row.GetCursor()] = true
	}
}
