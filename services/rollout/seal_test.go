package rollout

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestSeal(t *testing.T) {
	const secret = "controller-bearer-7d1e"
	s, err := newSeal("service-key")
	if err != nil {
		t.Fatal(err)
	}
	other, _ := newSeal("another-key")
	none, _ := newSeal("")

	b := s.bytes([]byte("request holding " + secret))
	if bytes.Contains(b, []byte(secret)) {
		t.Fatalf("sealed bytes hold the secret: %q", b)
	}
	if got, err := s.open(b); err != nil || string(got) != "request holding "+secret {
		t.Fatalf("open(seal(x)) = %q, %v", got, err)
	}
	for name, sl := range map[string]seal{"another key": other, "no key": none} {
		if _, err := sl.open(b); !errors.Is(err, errSealed) {
			t.Errorf("open with %s: %v, want errSealed", name, err)
		}
	}
	// State written unsealed (no key then, or an older build) still opens.
	if got, err := s.open([]byte("\x0a\x03abc")); err != nil || string(got) != "\x0a\x03abc" {
		t.Errorf("open(unsealed) = %q, %v", got, err)
	}
	// Two seals of one value differ (a fresh nonce each).
	if bytes.Equal(s.bytes([]byte("x")), s.bytes([]byte("x"))) {
		t.Error("two seals of one value are equal")
	}

	txt := s.text(secret)
	if strings.Contains(txt, secret) || !strings.HasPrefix(txt, sealedText) {
		t.Fatalf("sealed text %q", txt)
	}
	if got, err := s.openText(txt); err != nil || got != secret {
		t.Errorf("openText(text(x)) = %q, %v", got, err)
	}
	if got, err := s.openText("plain"); err != nil || got != "plain" {
		t.Errorf("openText(plain) = %q, %v", got, err)
	}
	if _, err := other.openText(txt); !errors.Is(err, errSealed) {
		t.Errorf("openText under another key: %v, want errSealed", err)
	}
	// Without a key nothing is sealed.
	if none.text(secret) != secret || string(none.bytes([]byte(secret))) != secret {
		t.Error("a seal without a key changed its input")
	}
}
