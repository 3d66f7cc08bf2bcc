package natsstore

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The acknowledgements a stream writes (nats-server's stream.go, for a
// stored message, a duplicate, a batch, a counter) and what else may come
// back: storedAck reads the first two shapes and leaves every other to
// encoding/json.
var acks = []struct {
	data string
	seq  uint64
	read bool // by storedAck
}{
	{`{"stream":"KV_osmo_rollouts","seq":1}`, 1, true},
	{`{"stream":"KV_osmo_rollouts","seq":18446744073709551615}`, 18446744073709551615, true},
	{`{"stream":"osmo_work","domain":"hub","seq":42}`, 42, true},
	{`{"stream":"osmo_work","seq":7,"duplicate": true}`, 7, true},
	{`{"stream":"s","seq":3,"batch":"b1","count":2}`, 3, false},
	{`{"stream":"s","seq":3,"val":"10"}`, 3, false},
	{`{"stream":"s","seq":3,"duplicate": true,"batch":"b","count":1}`, 3, false},
	{`{"stream":"s", "seq":3}`, 3, false},
	{`{"stream":"a\"b","seq":3}`, 3, false},
	{`{"stream":"s","seq":03}`, 0, false},
	{`{"stream":"s","seq":18446744073709551616}`, 0, false},
	{`{"stream":"s","seq":}`, 0, false},
	{`{"stream":"","seq":3}`, 0, false},
	{`{"stream":"s","seq":3}x`, 0, false},
	{`{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 4"},"stream":"KV_t","seq":0}`, 0, false},
	{`{"stream":"KV_t","seq":0,"error":{"code":503,"description":"JetStream system temporarily unavailable"}}`, 0, false},
	{``, 0, false},
	{`{"stream":"s"`, 0, false},
}

// TestStoredAckIsTheLibrarys: what storedAck reads, encoding/json reads
// to the same sequence and no error; what it does not read goes to
// decodeAck, which answers as jetstream's publish does.
func TestStoredAckIsTheLibrarys(t *testing.T) {
	for _, a := range acks {
		seq, read := storedAck([]byte(a.data))
		if read != a.read || read && seq != a.seq {
			t.Errorf("storedAck(%s) = %d, %v; want %d, %v", a.data, seq, read, a.seq, a.read)
		}
		if read {
			checkSameAsJSON(t, []byte(a.data), seq)
		}
	}
	seq, err := decodeAck([]byte(acks[14].data))
	var api *jetstream.APIError
	if seq != 0 || !errors.As(err, &api) || api.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence || !errors.Is(err, errRefused) {
		t.Errorf("decodeAck(a refusal) = %d, %v; want the API error, refused", seq, err)
	}
	if _, err := decodeAck([]byte(`{"stream":"","seq":3}`)); !errors.Is(err, jetstream.ErrInvalidJSAck) || errors.Is(err, errRefused) {
		t.Errorf("decodeAck(no stream) = %v; want ErrInvalidJSAck", err)
	}
	if _, err := decodeAck([]byte(`{"stream"`)); !errors.Is(err, jetstream.ErrInvalidJSAck) {
		t.Errorf("decodeAck(not JSON) = %v; want ErrInvalidJSAck", err)
	}
	if seq, err := decodeAck([]byte(acks[4].data)); seq != 3 || err != nil {
		t.Errorf("decodeAck(a batch's) = %d, %v; want 3", seq, err)
	}
}

func FuzzStoredAck(f *testing.F) {
	for _, a := range acks {
		f.Add([]byte(a.data))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if seq, ok := storedAck(data); ok {
			checkSameAsJSON(t, data, seq)
		}
	})
}

// checkSameAsJSON: data, read by storedAck as seq, is a stored message's
// acknowledgement for encoding/json too (the library's reading).
func checkSameAsJSON(t *testing.T, data []byte, seq uint64) {
	t.Helper()
	var ack struct {
		Error    *jetstream.APIError `json:"error"`
		Stream   string              `json:"stream"`
		Sequence uint64              `json:"seq"`
	}
	if err := json.Unmarshal(data, &ack); err != nil || ack.Error != nil || ack.Stream == "" || ack.Sequence != seq {
		t.Errorf("storedAck read %q as %d; encoding/json: %+v, %v", data, seq, ack, err)
	}
}

func TestValidKeyIsTheLibrarys(t *testing.T) {
	for key, want := range map[string]bool{
		"a": true, "aGVsbG8": true, "a-b_c=d/e.f": true, "_": true, "0.9": true,
		"": false, ".a": false, "a.": false, "a..b": false, "a b": false, "a*": false, "a>": false, "é": false,
	} {
		if got := validKey(key); got != want {
			t.Errorf("validKey(%q) = %v, want %v", key, got, want)
		}
	}
}

// TestLeanWritesAnswerAsTheLibrary makes the same writes through a lean
// bucket and the library's and compares each answer: the revisions, and
// the errors a caller tells apart (a key that exists, a stale revision,
// an invalid key), a deletion marker and a purge written over, a TTL.
func TestLeanWritesAnswerAsTheLibrary(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := Open(ctx, Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	open := func(bucket string) jetstream.KeyValue {
		kv, err := st.JS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, History: 1, LimitMarkerTTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return kv
	}
	lean, lib := st.LeanWrites(open("lean")), open("lib")
	if _, ok := lean.(*leanKV); !ok || st.LeanWrites(lean) != lean {
		t.Fatal("LeanWrites does not wrap once")
	}

	type answer struct {
		rev                            uint64
		exists, mismatch, invalid, any bool
	}
	of := func(rev uint64, err error) answer {
		return answer{rev, errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyRevisionMismatch),
			errors.Is(err, jetstream.ErrInvalidKey), err != nil}
	}
	steps := []struct {
		name string
		do   func(kv jetstream.KeyValue) answer
	}{
		{"create", func(kv jetstream.KeyValue) answer { return of(kv.Create(ctx, "k", []byte("1"))) }},
		{"create again", func(kv jetstream.KeyValue) answer { return of(kv.Create(ctx, "k", []byte("2"))) }},
		{"update", func(kv jetstream.KeyValue) answer { return of(kv.Update(ctx, "k", []byte("3"), 1)) }},
		{"update stale", func(kv jetstream.KeyValue) answer { return of(kv.Update(ctx, "k", []byte("4"), 1)) }},
		{"update missing", func(kv jetstream.KeyValue) answer { return of(kv.Update(ctx, "m", []byte("4"), 9)) }},
		{"put", func(kv jetstream.KeyValue) answer { return of(kv.Put(ctx, "p", []byte("5"))) }},
		{"put invalid", func(kv jetstream.KeyValue) answer { return of(kv.Put(ctx, "a b", []byte("5"))) }},
		{"create invalid", func(kv jetstream.KeyValue) answer { return of(kv.Create(ctx, ".a", []byte("5"))) }},
		{"update invalid", func(kv jetstream.KeyValue) answer { return of(kv.Update(ctx, "a..b", []byte("5"), 1)) }},
		{"create over a deletion", func(kv jetstream.KeyValue) answer {
			if err := kv.Delete(ctx, "k"); err != nil {
				t.Fatal(err)
			}
			return of(kv.Create(ctx, "k", []byte("6")))
		}},
		{"create over a purge", func(kv jetstream.KeyValue) answer {
			if err := kv.Purge(ctx, "p"); err != nil {
				t.Fatal(err)
			}
			return of(kv.Create(ctx, "p", []byte("7")))
		}},
		{"create with a TTL", func(kv jetstream.KeyValue) answer {
			return of(kv.Create(ctx, "t", []byte("8"), jetstream.KeyTTL(time.Minute)))
		}},
	}
	for _, s := range steps {
		l, w := s.do(lean), s.do(lib)
		if l != w {
			t.Errorf("%s: lean %+v, library %+v", s.name, l, w)
		}
	}
	for _, key := range []string{"k", "p", "t"} {
		l, err1 := lean.Get(ctx, key)
		w, err2 := lib.Get(ctx, key)
		if err1 != nil || err2 != nil || string(l.Value()) != string(w.Value()) || l.Revision() != w.Revision() {
			t.Errorf("%s: lean %v %v, library %v %v", key, l, err1, w, err2)
		}
	}
}

// TestPublishAnswersAsTheLibrary: a message id seen before is a
// duplicate, answered with the first one's sequence; a subject no stream
// takes is the library's ErrNoStreamResponse, after its retries.
func TestPublishAnswersAsTheLibrary(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := Open(ctx, Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Stream(ctx, jetstream.StreamConfig{Name: "q", Subjects: []string{"q.>"}, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	msg := func(id string) *nats.Msg {
		m := nats.NewMsg("q.a")
		m.Header.Set(jetstream.MsgIDHeader, id)
		return m
	}
	first, err := st.Publish(ctx, msg("one"))
	if err != nil || first == 0 {
		t.Fatalf("Publish = %d, %v", first, err)
	}
	if seq, err := st.Publish(ctx, msg("two")); err != nil || seq != first+1 {
		t.Errorf("Publish(another) = %d, %v; want %d", seq, err, first+1)
	}
	if seq, err := st.Publish(ctx, msg("one")); err != nil || seq != first {
		t.Errorf("Publish(a duplicate) = %d, %v; want %d", seq, err, first)
	}
	if _, err := st.Publish(ctx, nats.NewMsg("nowhere")); !errors.Is(err, jetstream.ErrNoStreamResponse) {
		t.Errorf("Publish(no stream) = %v; want %v", err, jetstream.ErrNoStreamResponse)
	}
}
