package otlpdirect

import (
	"math"
	"strings"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/sdk/resource"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protowire"
)

// Field numbers of the OTLP messages written here, from
// opentelemetry/proto/collector/trace/v1/trace_service.proto,
// trace/v1/trace.proto, resource/v1/resource.proto and common/v1/common.proto.
const (
	fieldRequestResourceSpans = 1 // ExportTraceServiceRequest.resource_spans

	fieldResourceSpansResource   = 1 // ResourceSpans.resource
	fieldResourceSpansScopeSpans = 2 // ResourceSpans.scope_spans
	fieldResourceSpansSchemaURL  = 3

	fieldResourceAttributes = 1 // Resource.attributes

	fieldScopeSpansScope     = 1 // ScopeSpans.scope
	fieldScopeSpansSpans     = 2 // ScopeSpans.spans
	fieldScopeSpansSchemaURL = 3

	fieldScopeName       = 1 // InstrumentationScope.name
	fieldScopeVersion    = 2
	fieldScopeAttributes = 3

	fieldSpanTraceID                = 1
	fieldSpanSpanID                 = 2
	fieldSpanTraceState             = 3
	fieldSpanParentSpanID           = 4
	fieldSpanName                   = 5
	fieldSpanKind                   = 6
	fieldSpanStartTime              = 7
	fieldSpanEndTime                = 8
	fieldSpanAttributes             = 9
	fieldSpanDroppedAttributesCount = 10
	fieldSpanEvents                 = 11
	fieldSpanDroppedEventsCount     = 12
	fieldSpanLinks                  = 13
	fieldSpanDroppedLinksCount      = 14
	fieldSpanStatus                 = 15
	fieldSpanFlags                  = 16

	fieldEventTime                   = 1
	fieldEventName                   = 2
	fieldEventAttributes             = 3
	fieldEventDroppedAttributesCount = 4

	fieldLinkAttributes             = 4
	fieldLinkDroppedAttributesCount = 5
	fieldLinkFlags                  = 6

	fieldStatusMessage = 2
	fieldStatusCode    = 3

	fieldKeyValueKey   = 1
	fieldKeyValueValue = 2

	fieldAnyString = 1 // AnyValue oneof
	fieldAnyBool   = 2
	fieldAnyInt    = 3
	fieldAnyDouble = 4
	fieldAnyArray  = 5
	fieldAnyKVList = 6
	fieldAnyBytes  = 7

	fieldArrayValues  = 1 // ArrayValue.values
	fieldKVListValues = 1 // KeyValueList.values

	// SpanFlags bits above the W3C trace flags: the span says whether its
	// parent is remote, and that it is.
	flagHasIsRemote = 0x100
	flagIsRemote    = 0x200

	// Status codes.
	statusOK    = 1
	statusError = 2
)

// encoder writes OTLP protobuf. Its string limit is the span limits'
// attribute value length (-1: none), applied as the SDK does, by
// characters, to the span's attributes.
type encoder struct {
	valueLimit int
}

// appendTag and appendVarint are protowire's, with the one-byte cases
// inlined: every field osmo writes but one has a one-byte tag, and most
// lengths are under 128.
func appendTag(b []byte, num protowire.Number, typ protowire.Type) []byte {
	if num < 16 {
		return append(b, byte(num)<<3|byte(typ))
	}
	return protowire.AppendTag(b, num, typ)
}

func appendVarint(b []byte, v uint64) []byte {
	if v < 0x80 {
		return append(b, byte(v))
	}
	return protowire.AppendVarint(b, v)
}

// appendLen appends a length-delimited field holding size bytes that the
// caller appends next.
func appendLen(b []byte, num protowire.Number, size int) []byte {
	b = appendTag(b, num, protowire.BytesType)
	return appendVarint(b, uint64(size))
}

func sizeLen(num protowire.Number, size int) int {
	return protowire.SizeTag(num) + protowire.SizeBytes(size)
}

// beginLen starts a length-delimited field whose length is not known yet:
// it appends the tag and a one-byte length, and returns where the field's
// bytes start, for endLen. Messages are encoded in one pass this way; the
// few longer than 127 bytes are moved to make room for their length.
func beginLen(b []byte, num protowire.Number) ([]byte, int) {
	b = appendTag(b, num, protowire.BytesType)
	return append(b, 0), len(b) + 1
}

// endLen sets the length of the field begun at start.
func endLen(b []byte, start int) []byte {
	n := len(b) - start
	if n < 0x80 {
		b[start-1] = byte(n)
		return b
	}
	k := protowire.SizeVarint(uint64(n))
	for range k - 1 {
		b = append(b, 0)
	}
	copy(b[start+k-1:], b[start:start+n])
	protowire.AppendVarint(b[:start-1], uint64(n))
	return b
}

// appendString appends a string field, left out when empty as proto3 does.
func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = appendTag(b, num, protowire.BytesType)
	return appendBytes(b, validUTF8(s))
}

// appendBytes appends a length-prefixed string.
func appendBytes(b []byte, s string) []byte {
	return append(appendVarint(b, uint64(len(s))), s...)
}

func appendUint(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = appendTag(b, num, protowire.VarintType)
	return appendVarint(b, v)
}

func appendFixed64(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = appendTag(b, num, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, v)
}

// validUTF8 is s with invalid bytes replaced: a protobuf string must be
// UTF-8, and a collector rejects the whole request over one that is not.
func validUTF8(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	return strings.ToValidUTF8(s, string(utf8.RuneError))
}

// truncate cuts s to the value length limit in characters.
func (e encoder) truncate(s string) string {
	if e.valueLimit < 0 || len(s) <= e.valueLimit {
		return s
	}
	n := 0
	for i := range s {
		if n == e.valueLimit {
			return s[:i]
		}
		n++
	}
	return s
}

// appendValue appends v as the fields of an AnyValue message.
func (e encoder) appendValue(b []byte, v attribute.Value) []byte {
	switch v.Type() {
	case attribute.BOOL:
		return appendBool(b, v.AsBool())
	case attribute.INT64:
		return appendInt(b, v.AsInt64())
	case attribute.FLOAT64:
		return appendDouble(b, v.AsFloat64())
	case attribute.STRING:
		return e.appendStringValue(b, v.AsString())
	case attribute.BYTESLICE:
		p := v.AsByteSlice()
		if e.valueLimit >= 0 && len(p) > e.valueLimit {
			p = p[:e.valueLimit]
		}
		b = appendTag(b, fieldAnyBytes, protowire.BytesType)
		return protowire.AppendBytes(b, p)
	case attribute.EMPTY:
		return b
	case attribute.MAP:
		b, start := beginLen(b, fieldAnyKVList)
		b = e.appendKeyValues(b, fieldKVListValues, v.AsMap())
		return endLen(b, start)
	case attribute.BOOLSLICE:
		return appendArray(b, v.AsBoolSlice(), appendBool)
	case attribute.INT64SLICE:
		return appendArray(b, v.AsInt64Slice(), appendInt)
	case attribute.FLOAT64SLICE:
		return appendArray(b, v.AsFloat64Slice(), appendDouble)
	case attribute.STRINGSLICE:
		return appendArray(b, v.AsStringSlice(), e.appendStringValue)
	case attribute.SLICE:
		return appendArray(b, v.AsSlice(), e.appendValue)
	}
	b = appendTag(b, fieldAnyString, protowire.BytesType)
	return appendBytes(b, "INVALID")
}

func appendBool(b []byte, v bool) []byte {
	b = appendTag(b, fieldAnyBool, protowire.VarintType)
	return appendVarint(b, protowire.EncodeBool(v))
}

func appendInt(b []byte, v int64) []byte {
	b = appendTag(b, fieldAnyInt, protowire.VarintType)
	return appendVarint(b, uint64(v))
}

func appendDouble(b []byte, v float64) []byte {
	b = appendTag(b, fieldAnyDouble, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, math.Float64bits(v))
}

func (e encoder) appendStringValue(b []byte, s string) []byte {
	b = appendTag(b, fieldAnyString, protowire.BytesType)
	return appendBytes(b, validUTF8(e.truncate(s)))
}

// appendArray appends an ArrayValue of the elements, each an AnyValue
// written by value.
func appendArray[T any](b []byte, elems []T, value func([]byte, T) []byte) []byte {
	b, start := beginLen(b, fieldAnyArray)
	for _, x := range elems {
		var at int
		b, at = beginLen(b, fieldArrayValues)
		b = value(b, x)
		b = endLen(b, at)
	}
	return endLen(b, start)
}

// appendKeyValues appends kvs as repeated KeyValue field num.
func (e encoder) appendKeyValues(b []byte, num protowire.Number, kvs []attribute.KeyValue) []byte {
	for _, kv := range kvs {
		var kvStart, vStart int
		b, kvStart = beginLen(b, num)
		b = appendTag(b, fieldKeyValueKey, protowire.BytesType)
		b = appendBytes(b, validUTF8(string(kv.Key)))
		b, vStart = beginLen(b, fieldKeyValueValue)
		b = e.appendValue(b, kv.Value)
		b = endLen(b, vStart)
		b = endLen(b, kvStart)
	}
	return b
}

func spanFlags(tf trace.TraceFlags, parentRemote bool) uint32 {
	f := uint32(tf) | flagHasIsRemote
	if parentRemote {
		f |= flagIsRemote
	}
	return f
}

// appendIDs appends trace_id, span_id and trace_state, which Span and
// Span.Link number alike.
func appendIDs(b []byte, sc trace.SpanContext) []byte {
	tid, sid := sc.TraceID(), sc.SpanID()
	b = appendTag(b, fieldSpanTraceID, protowire.BytesType)
	b = protowire.AppendBytes(b, tid[:])
	b = appendTag(b, fieldSpanSpanID, protowire.BytesType)
	b = protowire.AppendBytes(b, sid[:])
	if ts := sc.TraceState(); ts.Len() > 0 {
		b = appendString(b, fieldSpanTraceState, ts.String())
	}
	return b
}

// appendSpan appends the fields of s's Span message.
func (e encoder) appendSpan(b []byte, s *span) []byte {
	b = appendIDs(b, s.sc)
	if psid := s.parent.SpanID(); psid.IsValid() {
		b = appendTag(b, fieldSpanParentSpanID, protowire.BytesType)
		b = protowire.AppendBytes(b, psid[:])
	}
	b = appendString(b, fieldSpanName, s.name)
	b = appendUint(b, fieldSpanKind, uint64(s.kind))
	b = appendFixed64(b, fieldSpanStartTime, unixNano(s.start))
	b = appendFixed64(b, fieldSpanEndTime, unixNano(s.end))
	b = e.appendKeyValues(b, fieldSpanAttributes, s.attrs)
	b = appendUint(b, fieldSpanDroppedAttributesCount, uint64(s.droppedAttrs))
	// As in the SDK, the value length limit applies to the span's own
	// attributes, not to those of its events and links.
	e = encoder{valueLimit: -1}
	for i := range s.events {
		ev := &s.events[i]
		var start int
		b, start = beginLen(b, fieldSpanEvents)
		b = appendFixed64(b, fieldEventTime, unixNano(ev.time))
		b = appendString(b, fieldEventName, ev.name)
		b = e.appendKeyValues(b, fieldEventAttributes, ev.attrs)
		b = appendUint(b, fieldEventDroppedAttributesCount, uint64(ev.dropped))
		b = endLen(b, start)
	}
	b = appendUint(b, fieldSpanDroppedEventsCount, uint64(s.droppedEvents))
	for i := range s.links {
		var start int
		b, start = beginLen(b, fieldSpanLinks)
		b = e.appendLink(b, &s.links[i])
		b = endLen(b, start)
	}
	b = appendUint(b, fieldSpanDroppedLinksCount, uint64(s.droppedLinks))
	// The SDK's exporter always sends a status, empty when unset; OTLP
	// numbers the codes differently from the API.
	code := uint64(0)
	switch s.status.Code {
	case codes.Ok:
		code = statusOK
	case codes.Error:
		code = statusError
	}
	b, start := beginLen(b, fieldSpanStatus)
	if code == statusError {
		b = appendString(b, fieldStatusMessage, s.status.Description)
	}
	b = appendUint(b, fieldStatusCode, code)
	b = endLen(b, start)
	b = appendTag(b, fieldSpanFlags, protowire.Fixed32Type)
	return protowire.AppendFixed32(b, spanFlags(s.sc.TraceFlags(), s.parent.IsRemote()))
}

func (e encoder) appendLink(b []byte, l *link) []byte {
	b = appendIDs(b, l.sc)
	b = e.appendKeyValues(b, fieldLinkAttributes, l.attrs)
	b = appendUint(b, fieldLinkDroppedAttributesCount, uint64(l.dropped))
	b = appendTag(b, fieldLinkFlags, protowire.Fixed32Type)
	return protowire.AppendFixed32(b, spanFlags(l.sc.TraceFlags(), l.sc.IsRemote()))
}

// encodeResource is the Resource message of res (nil: none).
func encodeResource(res *resource.Resource) []byte {
	if res == nil {
		return nil
	}
	e := encoder{valueLimit: -1}
	return e.appendKeyValues(nil, fieldResourceAttributes, res.Attributes())
}

// encodeScope is the InstrumentationScope message of a tracer, nil when
// everything in it is empty (the SDK's exporter then sends no scope).
func encodeScope(name, version string, attrs []attribute.KeyValue) []byte {
	if name == "" && version == "" && len(attrs) == 0 {
		return nil
	}
	e := encoder{valueLimit: -1}
	b := appendString(nil, fieldScopeName, name)
	b = appendString(b, fieldScopeVersion, version)
	return e.appendKeyValues(b, fieldScopeAttributes, attrs)
}
