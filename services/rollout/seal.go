package rollout

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
)

// seal encrypts the trainers' secrets the shared state keeps for recovery
// (the request and each owed callback's bearer): a replica concluding
// another's rollout needs them, whoever reads NATS should not get them.
// The key is derived from the service's API key, which every replica
// shares; without one nothing is sealed. Unsealed state still opens.
type seal struct {
	aead cipher.AEAD // nil: no key, values stay as they are
}

// sealMagic starts a sealed value; a proto or JSON value never does (a
// proto field's tag is never 0).
var sealMagic = []byte("\x00osmo-seal-1\x00")

// sealedText starts a sealed string (a callback's bearer in JSON).
const sealedText = "osmo-seal-1:"

// errSealed: a sealed value the service cannot open (its key differs
// from the one that sealed it).
var errSealed = errors.New("shared state sealed under another --api-key: every replica must have the same key")

func newSeal(apiKey string) (seal, error) {
	if apiKey == "" {
		return seal{}, nil
	}
	key, err := hkdf.Key(sha256.New, []byte(apiKey), nil, "osmo rollout state v1", 32)
	if err != nil {
		return seal{}, err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return seal{}, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return seal{}, err
	}
	return seal{aead: aead}, nil
}

// bytes seals b (nil stays nil).
func (s seal) bytes(b []byte) []byte {
	if s.aead == nil || b == nil {
		return b
	}
	out := make([]byte, 0, len(sealMagic)+s.aead.NonceSize()+len(b)+s.aead.Overhead())
	out = append(out, sealMagic...)
	nonce := make([]byte, s.aead.NonceSize())
	_, _ = rand.Read(nonce) // never fails (crypto/rand)
	out = append(out, nonce...)
	return s.aead.Seal(out, nonce, b, sealMagic)
}

// open returns what bytes sealed, or b itself when it was not sealed.
func (s seal) open(b []byte) ([]byte, error) {
	if !bytes.HasPrefix(b, sealMagic) {
		return b, nil
	}
	if s.aead == nil {
		return nil, errSealed
	}
	rest := b[len(sealMagic):]
	n := s.aead.NonceSize()
	if len(rest) < n {
		return nil, fmt.Errorf("sealed value truncated")
	}
	out, err := s.aead.Open(nil, rest[:n], rest[n:], sealMagic)
	if err != nil {
		return nil, errSealed
	}
	return out, nil
}

// text seals a string ("" stays "").
func (s seal) text(v string) string {
	if s.aead == nil || v == "" {
		return v
	}
	return sealedText + base64.RawStdEncoding.EncodeToString(s.bytes([]byte(v)))
}

// openText returns what text sealed, or v itself when it was not sealed.
func (s seal) openText(v string) (string, error) {
	enc, ok := strings.CutPrefix(v, sealedText)
	if !ok {
		return v, nil
	}
	b, err := base64.RawStdEncoding.DecodeString(enc)
	if err != nil {
		return "", fmt.Errorf("sealed value: %w", err)
	}
	out, err := s.open(b)
	return string(out), err
}
