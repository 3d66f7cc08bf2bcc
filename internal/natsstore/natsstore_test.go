package natsstore_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/natsstore"
)

func TestKeyRoundTrip(t *testing.T) {
	for _, id := range []string{"", "r-1", "a.b c/ü", strings.Repeat("x", 300), "\x00\xff"} {
		k := natsstore.Key(id)
		if strings.ContainsAny(k, ". *>") {
			t.Errorf("Key(%q) = %q: not a valid subject token", id, k)
		}
		back, err := natsstore.ID(k)
		if err != nil || back != id {
			t.Errorf("ID(Key(%q)) = %q, %v", id, back, err)
		}
	}
}

// TestEmbeddedFileStoreSurvivesRestart: with a Dir, what was written is
// there after the store is closed and opened again.
func TestEmbeddedFileStoreSurvivesRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	put := func(st *natsstore.Store) jetstream.KeyValue {
		kv, err := st.KeyValue(ctx, jetstream.KeyValueConfig{Bucket: "t"})
		if err != nil {
			t.Fatal(err)
		}
		return kv
	}
	st, err := natsstore.Open(ctx, natsstore.Config{Dir: dir, Sync: natsstore.SyncAlways})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Embedded() || st.Private() || st.Replicas() != 1 {
		t.Errorf("embedded %v, private %v, replicas %d; want an embedded store of one copy that outlives the process", st.Embedded(), st.Private(), st.Replicas())
	}
	if _, err := put(st).Put(ctx, natsstore.Key("r-1"), []byte("v")); err != nil {
		t.Fatal(err)
	}
	_ = st.Close()
	st, err = natsstore.Open(ctx, natsstore.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	e, err := put(st).Get(ctx, natsstore.Key("r-1"))
	if err != nil || string(e.Value()) != "v" {
		t.Fatalf("after a restart: %v %v", e, err)
	}
}

func TestMemoryStoreStartsEmpty(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.Private() {
		t.Error("an embedded memory store is not private to its process")
	}
	kv, err := st.KeyValue(ctx, jetstream.KeyValueConfig{Bucket: "t"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Get(ctx, "x"); err == nil {
		t.Fatal("a new memory store holds a key")
	}
}

// TestUnreachableNamesTheURL: a cluster nobody listens on is an error
// naming it, soon.
func TestUnreachableNamesTheURL(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "nats://" + ln.Addr().String()
	ln.Close()
	start := time.Now()
	_, err = natsstore.Open(context.Background(), natsstore.Config{URLs: []string{url}, Timeout: 2 * time.Second})
	if err == nil || !strings.Contains(err.Error(), url) {
		t.Fatalf("Open(%s) = %v, want an error naming the URL", url, err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("took %s to fail", took)
	}
}

func TestBadSync(t *testing.T) {
	_, err := natsstore.Open(context.Background(), natsstore.Config{Dir: t.TempDir(), Sync: "sometimes"})
	if err == nil || !strings.Contains(err.Error(), "sync") {
		t.Fatalf("err = %v", err)
	}
}

// TestSetupRetriesWhatIsNotReady: a step that times out, or that JetStream
// answers with a 5xx or "no suitable peers", is tried again; one refused
// for good is not; and a step never ready gives up after StartTimeout.
func TestSetupRetriesWhatIsNotReady(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := natsstore.Open(ctx, natsstore.Config{StartTimeout: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	notReady := []error{
		context.DeadlineExceeded,
		nats.ErrNoResponders,
		&jetstream.APIError{Code: 503, ErrorCode: 10023, Description: "insufficient resources"},
		&jetstream.APIError{Code: 400, ErrorCode: 10005, Description: "no suitable peers for placement"},
	}
	tries := 0
	err = st.Setup(ctx, "test", func(context.Context) error {
		if tries++; tries <= len(notReady) {
			return fmt.Errorf("step: %w", notReady[tries-1])
		}
		return nil
	})
	if err != nil || tries != len(notReady)+1 {
		t.Errorf("after %d not-ready answers: err %v, %d tries", len(notReady), err, tries)
	}

	for _, refused := range []error{jetstream.ErrJetStreamNotEnabled, jetstream.ErrStreamNameAlreadyInUse, errors.New("bad config")} {
		tries = 0
		err = st.Setup(ctx, "test", func(context.Context) error { tries++; return refused })
		if !errors.Is(err, refused) || tries != 1 {
			t.Errorf("refused with %v: err %v after %d tries, want it after 1", refused, err, tries)
		}
	}

	start := time.Now()
	tries = 0
	err = st.Setup(ctx, "test", func(context.Context) error { tries++; return context.DeadlineExceeded })
	if took := time.Since(start); !errors.Is(err, context.DeadlineExceeded) || took > 5*time.Second || tries < 3 {
		t.Errorf("never ready: err %v after %d tries and %v, want a timeout after StartTimeout (2s)", err, tries, took)
	}
}
