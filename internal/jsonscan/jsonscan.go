// Package jsonscan reads the few fields a caller needs from a JSON document
// that json.Valid accepted, in one pass and without reflection, passing over
// the rest byte for byte. Where a document holds what it cannot read exactly
// as encoding/json would (a key written with escapes, in another case or
// twice; a value of another type; a number out of range) a reader reports
// false, and the caller decodes the document with encoding/json instead:
// each caller holds the two to the same result with a differential fuzz
// target.
//
// Every function takes the document and the index of a value in it, and
// returns the index after what it read. Given a document json.Valid did not
// accept, the results are meaningless (but no index is out of range).
package jsonscan

import (
	"bytes"
	"encoding/json"
	"strconv"
	"unicode/utf8"
)

// SkipSpace returns the index of the first byte from b[i] on that is not
// white space.
func SkipSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// SkipString returns the index after the string starting at b[i] == '"'.
// It jumps from quote to quote, which is fast on long message contents.
func SkipString(b []byte, i int) int {
	i++
	for {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return len(b)
		}
		q := i + j
		bs := 0
		for k := q - 1; k >= i && b[k] == '\\'; k-- {
			bs++
		}
		if bs%2 == 0 {
			return q + 1
		}
		i = q + 1
	}
}

// SkipValue returns the index after the value starting at b[i].
func SkipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return SkipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = SkipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	default:
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i
			}
			i++
		}
		return i
	}
}

// Keys are the keys Members reads, in the order it numbers them.
type Keys [][]byte

// NewKeys is names as Keys.
func NewKeys(names ...string) Keys {
	out := make(Keys, len(names))
	for i, n := range names {
		out[i] = []byte(n)
	}
	return out
}

// Members calls f with the index in want of each member's key, for the
// object at b[i] ('{'); f reads the member's value at b[vi] and
// returns the index after it. Members whose key is not wanted are passed
// over. It returns the index after the object, and reports false, and
// stops, where f does, and on a key it cannot match as encoding/json
// would (escaped, of another case, a second time). An object of 64 wanted
// keys or more is not read.
func Members(b []byte, i int, want Keys, f func(k int, b []byte, vi int) (int, bool)) (int, bool) {
	if i >= len(b) || b[i] != '{' || len(want) >= 64 {
		return i, false
	}
	var seen uint64
	i = SkipSpace(b, i+1)
	for i < len(b) && b[i] != '}' {
		kEnd := SkipString(b, i)
		key := b[i+1 : kEnd-1]
		i = SkipSpace(b, SkipSpace(b, kEnd)+1) // past ':'
		if bytes.IndexByte(key, '\\') >= 0 {
			return i, false
		}
		k := -1
		for j, w := range want {
			if bytes.Equal(key, w) {
				k = j
				break
			}
			if bytes.EqualFold(key, w) {
				return i, false
			}
		}
		if k < 0 {
			i = SkipValue(b, i)
		} else {
			if seen&(1<<k) != 0 {
				return i, false
			}
			seen |= 1 << k
			var ok bool
			if i, ok = f(k, b, i); !ok {
				return i, false
			}
		}
		i = SkipSpace(b, i)
		if i < len(b) && b[i] == ',' {
			i = SkipSpace(b, i+1)
		}
	}
	return i + 1, true
}

// Object is Members of the object at b[i], or nothing for a null there,
// which encoding/json leaves a struct as it is for.
func Object(b []byte, i int, want Keys, f func(k int, b []byte, vi int) (int, bool)) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	return Members(b, i, want, f)
}

// Elements calls f with the index of each element of the array at
// b[i] ('['); f returns the index after the element. Elements returns
// the index after the array, and reports false where f does.
func Elements(b []byte, i int, f func(i int) (int, bool)) (int, bool) {
	i = SkipSpace(b, i+1)
	for i < len(b) && b[i] != ']' {
		var ok bool
		if i, ok = f(i); !ok {
			return i, false
		}
		i = SkipSpace(b, i)
		if i < len(b) && b[i] == ',' {
			i = SkipSpace(b, i+1)
		}
	}
	return i + 1, true
}

// String reads the string at b[i] into s (null leaves s as it is, as
// encoding/json does); encoding/json decodes a string with escapes or
// bytes that are not UTF-8 (which it replaces).
func String(b []byte, i int, s *string) (int, bool) {
	switch b[i] {
	case 'n':
		return i + 4, true
	case '"':
	default:
		return i, false
	}
	end := SkipString(b, i)
	inner := b[i+1 : end-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		*s = string(inner)
		return end, true
	}
	return end, json.Unmarshal(b[i:end], s) == nil
}

// Array is Elements of the array at b[i], or of none for a null there,
// which it reports (encoding/json makes null no slice, and [] an empty
// one); anything else is not read.
func Array(b []byte, i int, f func(i int) (int, bool)) (end int, null, ok bool) {
	switch b[i] {
	case 'n':
		return i + 4, true, true
	case '[':
		end, ok = Elements(b, i, f)
		return end, false, ok
	}
	return i, false, false
}

// Int32s reads the array of integers at b[i], each within int32 (null is
// no array; [] an empty one, not none, as encoding/json makes it).
func Int32s(b []byte, i int, out *[]int32) (int, bool) {
	ids := make([]int32, 0, 16)
	end, null, ok := Array(b, i, func(i int) (int, bool) {
		end := SkipValue(b, i)
		v := b[i:end]
		if !isInteger(v) {
			return end, false
		}
		n, err := strconv.ParseInt(string(v), 10, 32)
		ids = append(ids, int32(n))
		return end, err == nil
	})
	if null {
		ids = nil
	}
	*out = ids
	return end, ok
}

// Int reads the int at b[i] (null leaves it as it is).
func Int(b []byte, i int, n *int) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	end := SkipValue(b, i)
	if !isInteger(b[i:end]) {
		return end, false
	}
	x, err := strconv.ParseInt(string(b[i:end]), 10, 64)
	*n = int(x)
	return end, err == nil
}

// Float reads the float64 at b[i] (null leaves it as it is).
func Float(b []byte, i int, f *float64) (int, bool) {
	if b[i] == 'n' {
		return i + 4, true
	}
	end := SkipValue(b, i)
	if c := b[i]; c != '-' && (c < '0' || c > '9') {
		return end, false
	}
	x, err := strconv.ParseFloat(string(b[i:end]), 64)
	*f = x
	return end, err == nil
}

// isInteger: a JSON number without fraction or exponent.
func isInteger(v []byte) bool {
	if len(v) == 0 || v[0] != '-' && (v[0] < '0' || v[0] > '9') {
		return false
	}
	return !bytes.ContainsAny(v, ".eE")
}
