// Package structjson decodes JSON into google.protobuf.Struct values as
// protojson does, without its reflection, for the documents osmo reads on
// every rollout (recorded LLM calls, requests): a Parser reads plain JSON
// itself and says "not sure" of anything out of the ordinary, which the
// caller then hands to protojson. FuzzDecode holds Decode to protojson's
// answers on any input.
package structjson

import (
	"strconv"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
)

// Decode decodes a JSON object into a Struct, as protojson.Unmarshal
// does: the same Struct, or an error where protojson has one.
//
// Every recorded LLM call's messages and reply become Structs (a call's
// request and response, per message): through protojson, which decodes
// by reflection, that was a twentieth of the CPU of a rollout. The parser
// here takes what recorded calls hold, objects of plain JSON, and hands
// anything out of the ordinary to protojson itself: an escaped surrogate,
// invalid UTF-8, a control character, a number out of float64's range,
// deep nesting, a duplicate key, any syntax error. FuzzDecode holds the
// two to the same answers.
func Decode(data []byte) (*structpb.Struct, error) {
	p := Parser{data: data}
	if s, ok := p.document(); ok {
		return s, nil
	}
	s := &structpb.Struct{}
	if err := protojson.Unmarshal(data, s); err != nil {
		return nil, err
	}
	return s, nil
}

// maxDepth is how deep a Parser nests before it is not sure (protojson's
// own limit is far deeper).
const maxDepth = 64

// Parser parses JSON into Struct values as protojson would, from its
// position on; any false is "not sure" (an escaped surrogate, invalid
// UTF-8, a control character, a number out of float64's range, deep
// nesting, a duplicate key, any syntax error): the caller goes to
// protojson. Every method skips the space before what it reads.
type Parser struct {
	data  []byte
	i     int
	depth int
}

// NewParser is a Parser at the start of data.
func NewParser(data []byte) *Parser { return &Parser{data: data} }

// End reports whether nothing but space is left.
func (p *Parser) End() bool {
	p.space()
	return p.i == len(p.data)
}

// Next is the next byte that is not space (0 at the end).
func (p *Parser) Next() byte {
	p.space()
	if p.i >= len(p.data) {
		return 0
	}
	return p.data[p.i]
}

// Skip passes the byte at the position, which Next returned.
func (p *Parser) Skip() { p.i++ }

func (p *Parser) document() (*structpb.Struct, bool) {
	if !p.at('{') {
		return nil, false
	}
	s, ok := p.Object()
	if !ok {
		return nil, false
	}
	return s, p.End()
}

// at skips space and reports whether the next byte is c.
func (p *Parser) at(c byte) bool {
	p.space()
	return p.i < len(p.data) && p.data[p.i] == c
}

func (p *Parser) space() {
	for p.i < len(p.data) {
		switch p.data[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// Object parses an object (after any space).
func (p *Parser) Object() (*structpb.Struct, bool) {
	if !p.at('{') {
		return nil, false
	}
	if p.depth++; p.depth > maxDepth {
		return nil, false
	}
	defer func() { p.depth-- }()
	p.i++ // '{'
	s := &structpb.Struct{Fields: map[string]*structpb.Value{}}
	if p.at('}') {
		p.i++
		return s, true
	}
	for {
		if !p.at('"') {
			return nil, false
		}
		k, ok := p.String()
		if !ok {
			return nil, false
		}
		if _, dup := s.Fields[k]; dup {
			return nil, false
		}
		if !p.at(':') {
			return nil, false
		}
		p.i++
		v, ok := p.Value()
		if !ok {
			return nil, false
		}
		s.Fields[k] = v
		switch end, ok := p.After('}'); {
		case !ok:
			return nil, false
		case end:
			return s, true
		}
	}
}

// Value parses a value (after any space).
func (p *Parser) Value() (*structpb.Value, bool) {
	p.space()
	if p.i >= len(p.data) {
		return nil, false
	}
	switch c := p.data[p.i]; {
	case c == '{':
		s, ok := p.Object()
		if !ok {
			return nil, false
		}
		return structpb.NewStructValue(s), true
	case c == '[':
		return p.list()
	case c == '"':
		s, ok := p.String()
		if !ok {
			return nil, false
		}
		return structpb.NewStringValue(s), true
	case c == 't':
		return p.literal("true", structpb.NewBoolValue(true))
	case c == 'f':
		return p.literal("false", structpb.NewBoolValue(false))
	case c == 'n':
		return p.literal("null", structpb.NewNullValue())
	case c == '-' || (c >= '0' && c <= '9'):
		f, ok := p.Number()
		if !ok {
			return nil, false
		}
		return structpb.NewNumberValue(f), true
	}
	return nil, false
}

func (p *Parser) literal(word string, v *structpb.Value) (*structpb.Value, bool) {
	if len(p.data)-p.i < len(word) || string(p.data[p.i:p.i+len(word)]) != word {
		return nil, false
	}
	p.i += len(word)
	// "nullx" is not null: a literal ends where a value may end.
	if p.i < len(p.data) && isWordByte(p.data[p.i]) {
		return nil, false
	}
	return v, true
}

func isWordByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '+' || c == '.'
}

// list parses an array at p.i (its '[').
func (p *Parser) list() (*structpb.Value, bool) {
	if p.depth++; p.depth > maxDepth {
		return nil, false
	}
	defer func() { p.depth-- }()
	p.i++ // '['
	l := &structpb.ListValue{}
	if p.at(']') {
		p.i++
		return structpb.NewListValue(l), true
	}
	for {
		v, ok := p.Value()
		if !ok {
			return nil, false
		}
		l.Values = append(l.Values, v)
		switch end, ok := p.After(']'); {
		case !ok:
			return nil, false
		case end:
			return structpb.NewListValue(l), true
		}
	}
}

// After reads what follows a member of an object or an element of an
// array: a comma (more to come) or closer (the end, reported by end).
func (p *Parser) After(closer byte) (end, ok bool) {
	p.space()
	if p.i >= len(p.data) {
		return false, false
	}
	switch p.data[p.i] {
	case ',':
		p.i++
		return false, true
	case closer:
		p.i++
		return true, true
	}
	return false, false
}

// Number parses a number of JSON's grammar,
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, as a float64 (after any
// space).
func (p *Parser) Number() (float64, bool) {
	p.space()
	if p.i >= len(p.data) {
		return 0, false
	}
	start := p.i
	if p.data[p.i] == '-' {
		p.i++
	}
	digits := func() int {
		n := 0
		for p.i < len(p.data) && p.data[p.i] >= '0' && p.data[p.i] <= '9' {
			p.i++
			n++
		}
		return n
	}
	if p.i < len(p.data) && p.data[p.i] == '0' {
		p.i++
	} else if digits() == 0 {
		return 0, false
	}
	if p.i < len(p.data) && p.data[p.i] == '.' {
		p.i++
		if digits() == 0 {
			return 0, false
		}
	}
	if p.i < len(p.data) && (p.data[p.i] == 'e' || p.data[p.i] == 'E') {
		p.i++
		if p.i < len(p.data) && (p.data[p.i] == '+' || p.data[p.i] == '-') {
			p.i++
		}
		if digits() == 0 {
			return 0, false
		}
	}
	if p.i < len(p.data) && isWordByte(p.data[p.i]) {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(p.data[start:p.i]), 64)
	if err != nil {
		return 0, false
	}
	return f, true
}

// String parses a string (after any space). Escapes other than those of a
// character outside the surrogates, control characters and invalid UTF-8
// are left to protojson.
func (p *Parser) String() (string, bool) {
	if !p.at('"') {
		return "", false
	}
	p.i++ // '"'
	start := p.i
	// Most strings have no escape: they are the bytes between the quotes.
	for p.i < len(p.data) {
		c := p.data[p.i]
		switch {
		case c == '"':
			s := p.data[start:p.i]
			p.i++
			if !utf8.Valid(s) {
				return "", false
			}
			return string(s), true
		case c == '\\':
			return p.escapedString(start)
		case c < 0x20:
			return "", false
		}
		p.i++
	}
	return "", false
}

// escapedString finishes a string that has escapes, from its start.
func (p *Parser) escapedString(start int) (string, bool) {
	b := make([]byte, 0, p.i-start+16)
	b = append(b, p.data[start:p.i]...)
	for p.i < len(p.data) {
		c := p.data[p.i]
		switch {
		case c == '"':
			p.i++
			if !utf8.Valid(b) {
				return "", false
			}
			return string(b), true
		case c < 0x20:
			return "", false
		case c != '\\':
			b = append(b, c)
			p.i++
			continue
		}
		if p.i+1 >= len(p.data) {
			return "", false
		}
		e := p.data[p.i+1]
		p.i += 2
		switch e {
		case '"', '\\', '/':
			b = append(b, e)
		case 'b':
			b = append(b, '\b')
		case 'f':
			b = append(b, '\f')
		case 'n':
			b = append(b, '\n')
		case 'r':
			b = append(b, '\r')
		case 't':
			b = append(b, '\t')
		case 'u':
			if len(p.data)-p.i < 4 {
				return "", false
			}
			r, err := strconv.ParseUint(string(p.data[p.i:p.i+4]), 16, 32)
			if err != nil || (r >= 0xd800 && r <= 0xdfff) {
				return "", false
			}
			p.i += 4
			b = utf8.AppendRune(b, rune(r))
		default:
			return "", false
		}
	}
	return "", false
}
