package jsonenc_test

import (
	"bytes"
	"encoding/json"
	"math"
	"testing"

	"github.com/osmo-rl/osmo/internal/jsonenc"
)

// strings covers every class AppendString treats apart: plain text,
// quote and backslash, each control character, HTML's three, invalid
// UTF-8 (a lone byte, a truncated sequence, a surrogate's encoding), the
// JavaScript line separators, and multi-byte text.
var stringsToQuote = []string{
	"", "plain", `say "hi" \ back`, "a\nb\rc\td\be\ff\x00\x01\x1f\x7f", "<b> & </b>",
	"\xff", "ab\xe2\x82", "\xed\xa0\x80", "line\u2028para\u2029", "日本語 🙂", "\ufffd",
}

// TestAppendStringIsMarshal: byte for byte what encoding/json writes,
// appended after what b held.
func TestAppendStringIsMarshal(t *testing.T) {
	all := stringsToQuote
	for c := range 0x80 {
		all = append(all, string(rune(c)))
	}
	for _, s := range all {
		want, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		if got := jsonenc.AppendString([]byte("x"), s); !bytes.Equal(got, append([]byte("x"), want...)) {
			t.Errorf("AppendString(%q) = %s, want %s", s, got[1:], want)
		}
	}
}

// FuzzAppendString: any string is quoted as encoding/json quotes it.
func FuzzAppendString(f *testing.F) {
	for _, s := range stringsToQuote {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		if got := jsonenc.AppendString(nil, s); !bytes.Equal(got, want) {
			t.Errorf("AppendString(%q) = %s, want %s", s, got, want)
		}
	})
}

// floatsToFormat covers both forms and their edges: zero and its sign,
// integers, fractions, and magnitudes either side of 1e-6 and 1e21.
var floatsToFormat = []float64{
	0, math.Copysign(0, -1), 1, -1, 42, 0.5, 1.0 / 3, 4096, 1e20, 1e21, 123456789e13, 1e-6, 9.99e-7,
	1e-7, -2.5e-9, 1.5e300, math.MaxFloat64, math.SmallestNonzeroFloat64, 5e-324, 100e-9,
}

// TestAppendFloatIsMarshal: byte for byte what encoding/json writes for a
// float64, appended after what b held.
func TestAppendFloatIsMarshal(t *testing.T) {
	for _, f := range floatsToFormat {
		want, err := json.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		if got := jsonenc.AppendFloat([]byte("x"), f); !bytes.Equal(got, append([]byte("x"), want...)) {
			t.Errorf("AppendFloat(%v) = %s, want %s", f, got[1:], want)
		}
	}
}

// FuzzAppendFloat: any finite float64 is written as encoding/json writes
// it.
func FuzzAppendFloat(f *testing.F) {
	for _, v := range floatsToFormat {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v float64) {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return
		}
		want, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if got := jsonenc.AppendFloat(nil, v); !bytes.Equal(got, want) {
			t.Errorf("AppendFloat(%v) = %s, want %s", v, got, want)
		}
	})
}
