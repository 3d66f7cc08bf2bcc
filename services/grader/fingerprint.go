package grader

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
	"slices"

	"google.golang.org/protobuf/types/known/structpb"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// fingerprints returns, by sample id, the fingerprint of what the grader
// name (resolved) would see of each sample of req: the row's label and
// metadata as graderContext resolves them, and the sample's fields that
// toSample exposes. A stored grading answers a sample only when its
// fingerprint is the request's, so a new rollout that reuses an old id (or
// a request naming an id it does not own) is graded on its own content.
//
// It is SHA-256 over a canonical encoding of exactly those fields (the
// rollout id is the other half of the key, and trace context and timeout
// do not change a reward): each field tagged, strings and lists
// length-prefixed, numbers as their bits, presence told apart from zero
// where a grader can tell them apart, a Struct's keys sorted.
// TestFingerprintCoversWhatGradersSee changes every field of a sample in
// turn and holds the fingerprint to what graders see.
//
// It is written out rather than taken from the deterministic protobuf
// encoding of those fields, which reflects over every Struct entry and
// sorts its keys: about a fifth of what grading a rollout cost in
// `osmo serve`. Were this encoding ever changed, stored gradings would
// merely be graded once more.
func fingerprints(name string, req *graderv1.GradeRequest) map[string]string {
	var row fpEncoder
	row.str('g', name)
	if l := rowLabel(req); l != nil {
		row.str('l', *l)
	}
	row.structure('m', req.GetMetadata())
	out := make(map[string]string, len(req.GetSamples()))
	e := fpEncoder{b: make([]byte, 0, 1024)}
	for _, rs := range req.GetSamples() {
		e.b = append(e.b[:0], row.b...)
		e.sample(rs)
		sum := sha256.Sum256(e.b)
		out[rs.GetId()] = hex.EncodeToString(sum[:])
	}
	return out
}

// fpEncoder appends the canonical encoding.
type fpEncoder struct{ b []byte }

func (e *fpEncoder) tag(t byte)    { e.b = append(e.b, t) }
func (e *fpEncoder) uint(n uint64) { e.b = binary.AppendUvarint(e.b, n) }
func (e *fpEncoder) int(n int64)   { e.b = binary.AppendVarint(e.b, n) }

func (e *fpEncoder) f64(f float64) {
	e.b = binary.LittleEndian.AppendUint64(e.b, math.Float64bits(f))
}

func (e *fpEncoder) str(t byte, s string) {
	e.tag(t)
	e.uint(uint64(len(s)))
	e.b = append(e.b, s...)
}

func (e *fpEncoder) optF64(t byte, f *float64) {
	if f != nil {
		e.tag(t)
		e.f64(*f)
	}
}

// sample writes the fields of rs a grader sees (toSample); a count of
// shared request messages beyond the previous call's is the same as that
// count, to a grader.
func (e *fpEncoder) sample(rs *rolloutv1.RolloutSample) {
	e.str('i', rs.GetId())
	e.structs('M', rs.GetMessages())
	if rs.Label != nil {
		e.str('l', *rs.Label)
	}
	e.structure('m', rs.GetMetadata())
	e.optF64('r', rs.Reward)
	if rs.GetRemoveSample() {
		e.tag('x')
	}
	e.structure('e', rs.GetExtraFields())
	e.optF64('a', rs.AgentReward)
	e.str('f', rs.GetFinishReason())
	if m := rs.GetMetrics(); m != nil {
		e.tag('t')
		e.f64(m.GetTotalLatencyMs())
		e.f64(m.GetLlmLatencyMs())
		e.f64(m.GetToolLatencyMs())
		for _, n := range []int32{m.GetNumLlmCalls(), m.GetNumToolCalls(), m.GetPromptTokens(), m.GetResponseTokens(), m.GetMaxContextTokens()} {
			e.int(int64(n))
		}
	}
	calls := rs.GetLlmCalls()
	e.tag('C')
	e.uint(uint64(len(calls)))
	prevLen := 0
	for _, c := range calls {
		shared := max(0, min(c.GetSharedRequestMessages(), int32(prevLen)))
		prevLen = int(shared) + len(c.GetRequestMessages())
		e.str('i', c.GetId())
		e.str('o', c.GetModel())
		e.str('f', c.GetFinishReason())
		u := c.GetUsage()
		e.tag('u')
		e.int(int64(u.GetPromptTokens()))
		e.int(int64(u.GetCompletionTokens()))
		e.int(int64(u.GetTotalTokens()))
		e.int32s('p', c.GetPromptTokenIds())
		e.int32s('c', c.GetCompletionTokenIds())
		e.tag('L')
		e.uint(uint64(len(c.GetLogprobs())))
		for _, f := range c.GetLogprobs() {
			e.f64(f)
		}
		e.tag('d')
		e.f64(c.GetLatencyMs())
		e.tag('s')
		e.int(int64(c.GetStatusCode()))
		e.str('E', c.GetError())
		e.structs('R', c.GetRequestMessages())
		e.structure('A', c.GetResponseMessage())
		e.tag('S')
		e.int(int64(shared))
	}
}

func (e *fpEncoder) int32s(t byte, ns []int32) {
	e.tag(t)
	e.uint(uint64(len(ns)))
	for _, n := range ns {
		e.int(int64(n))
	}
}

func (e *fpEncoder) structs(t byte, ss []*structpb.Struct) {
	e.tag(t)
	e.uint(uint64(len(ss)))
	for _, s := range ss {
		e.structure('{', s)
	}
}

// structure writes s under tag t; an absent Struct writes nothing, so it
// differs from an empty one.
func (e *fpEncoder) structure(t byte, s *structpb.Struct) {
	if s == nil {
		return
	}
	e.tag(t)
	e.object(s)
}

func (e *fpEncoder) object(s *structpb.Struct) {
	fields := s.GetFields()
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	e.uint(uint64(len(keys)))
	for _, k := range keys {
		e.str('k', k)
		e.value(fields[k])
	}
}

func (e *fpEncoder) value(v *structpb.Value) {
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		e.str('s', k.StringValue)
	case *structpb.Value_NumberValue:
		e.tag('n')
		e.f64(k.NumberValue)
	case *structpb.Value_BoolValue:
		if k.BoolValue {
			e.tag('T')
		} else {
			e.tag('F')
		}
	case *structpb.Value_StructValue:
		e.tag('{')
		e.object(k.StructValue)
	case *structpb.Value_ListValue:
		vs := k.ListValue.GetValues()
		e.tag('[')
		e.uint(uint64(len(vs)))
		for _, x := range vs {
			e.value(x)
		}
	default: // null, or no kind: both null to a grader
		e.tag('0')
	}
}
