package jsonenc_test

import (
	"bytes"
	"encoding/json"
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
