package rollout

import "google.golang.org/protobuf/proto"

// What the service stores is encoded by the methods buf.gen.yaml generates
// beside each message (protoc-gen-go-vtproto), not by protobuf-go's
// reflection: a finished record holds every sample's messages and every
// call's as google.protobuf.Struct values, and protobuf-go's map coder
// allocates a copy of every key of every Struct through reflection, twice
// (sizing, then writing): 85 of the 1,900 objects osmo serve allocated per
// rollout, and 4% of its CPU (docs/performance.md, step 7).
// The bytes are the same protobuf wire format either way, so what one
// build stored another reads.

// vtMarshaler is a message with generated marshal code.
type vtMarshaler interface {
	MarshalVT() ([]byte, error)
}

// vtUnmarshaler is a message with generated unmarshal code.
type vtUnmarshaler interface {
	UnmarshalVT([]byte) error
}

// marshal encodes m, through its generated code when it has some.
func marshal(m proto.Message) ([]byte, error) {
	if v, ok := m.(vtMarshaler); ok {
		return v.MarshalVT()
	}
	return proto.Marshal(m)
}

// unmarshal decodes b into m, replacing what m held, through its generated
// code when it has some. Unlike proto.Unmarshal, the generated code does
// not check that strings are UTF-8: a record stored with an error message
// that is not (a workflow's error text) is read back as it was written.
func unmarshal(b []byte, m proto.Message) error {
	proto.Reset(m)
	if v, ok := m.(vtUnmarshaler); ok {
		return v.UnmarshalVT(b)
	}
	return proto.Unmarshal(b, m)
}
