package rollout

import (
	"math"
	"slices"
	"strconv"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/structpb"
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
		b = appendString(b, k)
		b = append(b, ':')
		b = appendValue(b, fields[k])
	}
	return append(b, '}')
}

func appendValue(b []byte, v *structpb.Value) []byte {
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return appendString(b, k.StringValue)
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

// appendNumber formats f as encoding/json formats a float64: decimal
// unless the exponent is very small or large.
func appendNumber(b []byte, f float64) []byte {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return append(b, "null"...)
	}
	format := byte('f')
	if abs := math.Abs(f); abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' {
		// 1e-07 as 1e-7.
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
}

const hexDigits = "0123456789abcdef"

// appendString quotes s as encoding/json's Marshal does: quote, backslash
// and control characters escaped, <, > and & as \u003c, \u003e and \u0026
// (Marshal's HTML escaping), invalid UTF-8 as U+FFFD, and U+2028 and U+2029
// escaped (for JavaScript readers).
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
