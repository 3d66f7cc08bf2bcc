package rollout

import (
	"math"
	"slices"
	"strconv"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo/internal/jsonenc"
)

// jsonStruct encodes a message (a google.protobuf.Struct) as the JSON
// object it holds, keys sorted as encoding/json sorts a map's. It stands in
// for protojson, whose reflection over every value and entry was most of
// what rendering a callback cost.
//
// A number JSON cannot hold (NaN, an infinity: a structpb.Value may carry
// one, protojson refuses it) is written as null rather than failing the
// whole callback.
type jsonStruct struct{ s *structpb.Struct }

func (j jsonStruct) MarshalJSON() ([]byte, error) {
	return j.append(make([]byte, 0, 256)), nil
}

// jsonStructs wraps each of msgs; nil is an empty list.
func jsonStructs(msgs []*structpb.Struct) []jsonStruct {
	out := make([]jsonStruct, len(msgs))
	for i, m := range msgs {
		out[i] = jsonStruct{m}
	}
	return out
}

func appendStruct(b []byte, s *structpb.Struct) []byte {
	fields := s.GetFields()
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = jsonenc.AppendString(b, k)
		b = append(b, ':')
		b = appendValue(b, fields[k])
	}
	return append(b, '}')
}

func appendValue(b []byte, v *structpb.Value) []byte {
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return jsonenc.AppendString(b, k.StringValue)
	case *structpb.Value_NumberValue:
		return appendNumber(b, k.NumberValue)
	case *structpb.Value_BoolValue:
		return strconv.AppendBool(b, k.BoolValue)
	case *structpb.Value_StructValue:
		return appendStruct(b, k.StructValue)
	case *structpb.Value_ListValue:
		b = append(b, '[')
		for i, e := range k.ListValue.GetValues() {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendValue(b, e)
		}
		return append(b, ']')
	default: // null, or no kind
		return append(b, "null"...)
	}
}

// appendNumber formats f as encoding/json formats a float64, and NaN and
// the infinities, which JSON has no form for, as null.
func appendNumber(b []byte, f float64) []byte {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return append(b, "null"...)
	}
	return jsonenc.AppendFloat(b, f)
}
