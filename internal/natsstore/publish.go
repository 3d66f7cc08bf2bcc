package natsstore

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publish stores m in the stream that takes its subject and returns the
// sequence it was stored at: jetstream.JetStream.PublishMsg without
// options (m carries its headers: an expected last sequence, a message id,
// a TTL), for the writes a rollout makes several of.
//
// The library decodes every acknowledgement with encoding/json, and under
// load that decode was the largest single cost of a write on the client's
// side. Publish reads the acknowledgement a stream sends for a stored
// message (fixed text: the stream, its domain, the sequence, a duplicate
// flag) directly, and anything else (a refusal, a shape it does not know)
// as the library does, into the same errors.
//
// A publish nobody answered (no responders: a stream's leader moving, or
// no such stream) stored nothing; it is handed to the library, which
// waits and tries again as it does for its own and returns its error.
func (s *Store) Publish(ctx context.Context, m *nats.Msg) (uint64, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.timeout)
		defer cancel()
	}
	resp, err := s.NC.RequestMsgWithContext(ctx, m)
	if errors.Is(err, nats.ErrNoResponders) {
		pa, err := s.JS.PublishMsg(ctx, m)
		if err != nil {
			return 0, err
		}
		return pa.Sequence, nil
	}
	if err != nil {
		return 0, err
	}
	if seq, ok := storedAck(resp.Data); ok {
		return seq, nil
	}
	return decodeAck(resp.Data)
}

// errRefused marks an acknowledgement that refused the message (it was
// not stored): see leanKV.
var errRefused = errors.New("natsstore: refused")

// decodeAck reads an acknowledgement as jetstream's publish does, to the
// same errors; a refusal also matches errRefused.
func decodeAck(data []byte) (uint64, error) {
	var ack struct {
		Error    *jetstream.APIError `json:"error,omitempty"`
		Stream   string              `json:"stream"`
		Sequence uint64              `json:"seq"`
	}
	if err := json.Unmarshal(data, &ack); err != nil {
		return 0, jetstream.ErrInvalidJSAck
	}
	if ack.Error != nil {
		return 0, refusal{fmt.Errorf("nats: %w", ack.Error)}
	}
	if ack.Stream == "" {
		return 0, jetstream.ErrInvalidJSAck
	}
	return ack.Sequence, nil
}

// refusal is an acknowledgement's error: it is the library's, and
// errRefused.
type refusal struct{ error }

func (r refusal) Unwrap() []error { return []error{r.error, errRefused} }

// storedAck reads the acknowledgement of a stored message as a stream
// writes it, {"stream":"NAME"[,"domain":"DOMAIN"],"seq":N[,"duplicate": true]},
// and reports whether data was one.
func storedAck(data []byte) (uint64, bool) {
	rest, ok := bytes.CutPrefix(data, []byte(`{"stream":"`))
	if !ok {
		return 0, false
	}
	if rest, ok = skipName(rest); !ok {
		return 0, false
	}
	if r, found := bytes.CutPrefix(rest, []byte(`,"domain":"`)); found {
		if rest, ok = skipName(r); !ok {
			return 0, false
		}
	}
	if rest, ok = bytes.CutPrefix(rest, []byte(`,"seq":`)); !ok {
		return 0, false
	}
	n := 0
	for n < len(rest) && rest[n] >= '0' && rest[n] <= '9' {
		n++
	}
	if n == 0 || n > 1 && rest[0] == '0' {
		return 0, false
	}
	seq, err := strconv.ParseUint(string(rest[:n]), 10, 64)
	if err != nil {
		return 0, false
	}
	switch string(rest[n:]) {
	case `}`, `,"duplicate": true}`:
		return seq, true
	}
	return 0, false
}

// skipName passes a name up to its closing quote, if it has neither
// escapes nor control characters (a name that does is left to
// encoding/json).
func skipName(b []byte) ([]byte, bool) {
	for i, c := range b {
		switch {
		case c == '"':
			return b[i+1:], i > 0
		case c == '\\' || c < 0x20:
			return nil, false
		}
	}
	return nil, false
}

// LeanWrites is kv, a bucket of this store's JetStream (its subjects
// "$KV.<bucket>.<key>": no mirror, no domain), whose Create, Update and
// Put are written through Publish. What the library does beyond a write
// it keeps: a write refused (a key that exists, a revision that is not
// the latest, a deletion marker to write over) is made again through the
// library, which answers it as it always does. A refused write stored
// nothing, so making it again is safe; one the server did not answer in
// time is not made again (it may have been stored).
func (s *Store) LeanWrites(kv jetstream.KeyValue) jetstream.KeyValue {
	if l, ok := kv.(*leanKV); ok {
		return l
	}
	return &leanKV{KeyValue: kv, s: s, pre: "$KV." + kv.Bucket() + "."}
}

type leanKV struct {
	jetstream.KeyValue
	s   *Store
	pre string
}

// Put stores value under key.
func (kv *leanKV) Put(ctx context.Context, key string, value []byte) (uint64, error) {
	if !validKey(key) {
		return kv.KeyValue.Put(ctx, key, value)
	}
	rev, err := kv.s.Publish(ctx, &nats.Msg{Subject: kv.pre + key, Data: value})
	if errors.Is(err, errRefused) {
		return kv.KeyValue.Put(ctx, key, value)
	}
	return rev, err
}

// Create stores value under key unless key has a value.
func (kv *leanKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	if len(opts) > 0 || !validKey(key) {
		return kv.KeyValue.Create(ctx, key, value, opts...)
	}
	rev, err := kv.write(ctx, key, value, 0)
	if errors.Is(err, errRefused) {
		return kv.KeyValue.Create(ctx, key, value)
	}
	return rev, err
}

// Update stores value under key if its latest revision is revision.
func (kv *leanKV) Update(ctx context.Context, key string, value []byte, revision uint64) (uint64, error) {
	if !validKey(key) {
		return kv.KeyValue.Update(ctx, key, value, revision)
	}
	rev, err := kv.write(ctx, key, value, revision)
	if errors.Is(err, errRefused) {
		return kv.KeyValue.Update(ctx, key, value, revision)
	}
	return rev, err
}

func (kv *leanKV) write(ctx context.Context, key string, value []byte, revision uint64) (uint64, error) {
	m := &nats.Msg{Subject: kv.pre + key, Data: value, Header: nats.Header{
		jetstream.ExpectedLastSubjSeqHeader: {strconv.FormatUint(revision, 10)},
	}}
	return kv.s.Publish(ctx, m)
}

// validKey is the library's test of a key (which it makes with a regular
// expression, a cost of its own on every write): letters, digits and
// "-/_=.", not starting or ending with a dot, no two dots in a row.
func validKey(key string) bool {
	if key == "" || key[0] == '.' || key[len(key)-1] == '.' {
		return false
	}
	for i := 0; i < len(key); i++ {
		switch c := key[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9',
			c == '-', c == '/', c == '_', c == '=':
		case c == '.':
			if key[i-1] == '.' {
				return false
			}
		default:
			return false
		}
	}
	return true
}
