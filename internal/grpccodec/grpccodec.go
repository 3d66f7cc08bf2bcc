// Package grpccodec is the protobuf codec osmo's gRPC servers and clients
// use: gRPC's own, except that a message with generated marshal code
// (every message under api/: buf.gen.yaml runs protoc-gen-go-vtproto) is
// encoded by that code rather than by protobuf-go's reflection.
//
// What osmo's services send each other is mostly google.protobuf.Struct:
// every sample's messages and every LLM call's, in the rollout service's
// Grade stream to the grader and in every finished rollout it serves.
// protobuf-go encodes a Struct's map through reflection, copying each key
// twice (sizing, then writing); the generated code does neither, and its
// bytes are the same wire format. Decoding is gRPC's: a receiver checks
// what it is sent (strings must be UTF-8) as it always did.
package grpccodec

import (
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// generated is a message with generated size and marshal code.
type generated interface {
	SizeVT() int
	MarshalToSizedBufferVT([]byte) (int, error)
}

// Codec is gRPC's "proto" codec, encoding generated messages through their
// generated code. The zero Codec is not usable: use New.
type Codec struct {
	fallback encoding.CodecV2
}

// New returns the codec; gRPC's proto codec serves what it does not.
func New() Codec {
	return Codec{fallback: encoding.GetCodecV2(protoenc.Name)}
}

// Name is gRPC's proto codec's: peers see no other content-subtype.
func (Codec) Name() string { return protoenc.Name }

// Marshal encodes v; a large message goes into a buffer of gRPC's pool, as
// gRPC's codec does, which gRPC frees once it is written.
func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(generated)
	if !ok {
		return c.fallback.Marshal(v)
	}
	size := m.SizeVT()
	if mem.IsBelowBufferPoolingThreshold(size) {
		b := make([]byte, size)
		if err := fill(m, b); err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(b)}, nil
	}
	pool := mem.DefaultBufferPool()
	b := pool.Get(size)
	if err := fill(m, *b); err != nil {
		pool.Put(b)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(b, pool)}, nil
}

// fill writes m into b, which is exactly its size.
func fill(m generated, b []byte) error {
	n, err := m.MarshalToSizedBufferVT(b)
	if err != nil {
		return fmt.Errorf("grpccodec: marshal %T: %w", m, err)
	}
	if n != len(b) {
		// The message changed between sizing and writing.
		return fmt.Errorf("grpccodec: marshal %T: wrote %d bytes of %d", m, n, len(b))
	}
	return nil
}

// Unmarshal is gRPC's proto codec's.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	return c.fallback.Unmarshal(data, v)
}

// ServerOption makes a gRPC server use the codec.
func ServerOption() grpc.ServerOption { return grpc.ForceServerCodecV2(New()) }

// DialOption makes a gRPC client connection's calls use the codec.
func DialOption() grpc.DialOption {
	return grpc.WithDefaultCallOptions(grpc.ForceCodecV2(New()))
}
