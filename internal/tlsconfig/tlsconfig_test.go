package tlsconfig

import (
	"crypto/tls"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/internal/tlsconfig/tlstest"
)

// serve runs a TLS server of src on loopback until the test ends: each
// connection that completes its handshake is answered "ok" and closed.
func serve(t *testing.T, src *Source) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", src.ServerConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				if c.(*tls.Conn).Handshake() == nil {
					_, _ = c.Write([]byte("ok"))
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// call connects to addr with cfg and returns the serial of the server's
// certificate once the server answered (a refused client certificate shows
// at the first read under TLS 1.3).
func call(t *testing.T, addr string, cfg *tls.Config) (*big.Int, error) {
	t.Helper()
	cfg.ServerName = "localhost"
	d := &net.Dialer{Timeout: 5 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(c); err != nil {
		return nil, err
	}
	return c.ConnectionState().PeerCertificates[0].SerialNumber, nil
}

// newSource loads files with checks on every handshake, logging to buf.
func newSource(t *testing.T, f tlstest.Files, buf *logtest.Buffer) *Source {
	t.Helper()
	src, err := New(Files(f), slog.New(slog.NewJSONHandler(buf, nil)))
	if err != nil {
		t.Fatal(err)
	}
	src.interval = 0
	return src
}

func TestReloadServesReplacedCertificate(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "ca")
	first := ca.Issue(t, "server")
	files := first.Write(t, dir, "server", ca)
	var logs logtest.Buffer
	src := newSource(t, files, &logs)
	addr := serve(t, src)
	client := newSource(t, ca.Issue(t, "client").Write(t, t.TempDir(), "client", ca), &logs)

	got, err := call(t, addr, client.ClientConfig())
	if err != nil || got.Cmp(first.Serial) != 0 {
		t.Fatalf("first call: serial %v, err %v; want %v", got, err, first.Serial)
	}
	second := ca.Issue(t, "server")
	second.Write(t, dir, "server", ca)
	got, err = call(t, addr, client.ClientConfig())
	if err != nil || got.Cmp(second.Serial) != 0 {
		t.Fatalf("after the rotation: serial %v, err %v; want %v", got, err, second.Serial)
	}
	if !strings.Contains(logs.String(), "reloaded the TLS certificate") {
		t.Errorf("no reload logged: %s", logs.String())
	}
}

func TestReloadWaitsForTheInterval(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "ca")
	first := ca.Issue(t, "server")
	files := first.Write(t, dir, "server", ca)
	src, err := New(Files(files), nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	src.now = func() time.Time { return now }
	ca.Issue(t, "server").Write(t, dir, "server", ca)
	if pair, _ := src.current(); pair.cert.Leaf.SerialNumber.Cmp(first.Serial) != 0 {
		t.Fatal("reloaded before the check interval passed")
	}
	now = now.Add(DefaultCheckInterval)
	if pair, _ := src.current(); pair.cert.Leaf.SerialNumber.Cmp(first.Serial) == 0 {
		t.Fatal("not reloaded once the check interval passed")
	}
}

func TestHalfRotatedPairKeepsTheOldOne(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "ca")
	first := ca.Issue(t, "server")
	files := first.Write(t, dir, "server", ca)
	var logs logtest.Buffer
	src := newSource(t, files, &logs)
	addr := serve(t, src)
	client := newSource(t, ca.Issue(t, "client").Write(t, t.TempDir(), "client", ca), &logs)

	// The certificate is replaced, its key not yet.
	second := ca.Issue(t, "server")
	tlstest.WriteFile(t, files.Cert, second.CertPEM)
	for range 3 {
		got, err := call(t, addr, client.ClientConfig())
		if err != nil || got.Cmp(first.Serial) != 0 {
			t.Fatalf("half rotated: serial %v, err %v; want the old %v", got, err, first.Serial)
		}
	}
	if n := strings.Count(logs.String(), "does not load"); n != 1 {
		t.Errorf("%d warnings about the half-written pair, want 1: %s", n, logs.String())
	}
	if !strings.Contains(logs.String(), `"level":"WARN"`) || !strings.Contains(logs.String(), files.Key) {
		t.Errorf("the warning names neither its level nor the key file: %s", logs.String())
	}
	// A key file missing for a moment is no worse.
	if err := os.Remove(files.Key); err != nil {
		t.Fatal(err)
	}
	if got, err := call(t, addr, client.ClientConfig()); err != nil || got.Cmp(first.Serial) != 0 {
		t.Fatalf("key missing: serial %v, err %v; want the old %v", got, err, first.Serial)
	}
	tlstest.WriteFile(t, files.Key, second.KeyPEM)
	if got, err := call(t, addr, client.ClientConfig()); err != nil || got.Cmp(second.Serial) != 0 {
		t.Fatalf("rotation done: serial %v, err %v; want %v", got, err, second.Serial)
	}
}

func TestMutualTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "ca")
	other := tlstest.NewCA(t, "other")
	var logs logtest.Buffer
	dir := t.TempDir()
	src := newSource(t, ca.Issue(t, "server").Write(t, dir, "server", ca), &logs)
	addr := serve(t, src)

	good := newSource(t, ca.Issue(t, "client").Write(t, t.TempDir(), "client", ca), &logs)
	if _, err := call(t, addr, good.ClientConfig()); err != nil {
		t.Fatalf("a client of the CA: %v", err)
	}
	// Trusts the server but has no certificate of its own.
	caOnly := t.TempDir() + "/ca.crt"
	tlstest.WriteFile(t, caOnly, ca.PEM)
	anon, err := New(Files{CA: caOnly}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := call(t, addr, anon.ClientConfig()); err == nil || !strings.Contains(err.Error(), "certificate required") {
		t.Errorf("a client without a certificate: %v, want certificate required", err)
	}
	// A certificate of another CA, and that CA as its trust.
	stranger := newSource(t, other.Issue(t, "client").Write(t, t.TempDir(), "client", other), &logs)
	if _, err := call(t, addr, stranger.ClientConfig()); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("a client of another CA: %v, want unknown authority", err)
	}

	// The server's CA file now holds both CAs (a CA rotation under way):
	// the other CA's clients are let in without a restart.
	tlstest.WriteFile(t, filepath.Join(dir, "ca.crt"), append(append([]byte{}, ca.PEM...), other.PEM...))
	both := t.TempDir()
	f := other.Issue(t, "client").Write(t, both, "client", other)
	tlstest.WriteFile(t, f.CA, ca.PEM) // it trusts the server's CA
	if _, err := call(t, addr, newSource(t, f, &logs).ClientConfig()); err != nil {
		t.Errorf("a client of the added CA: %v", err)
	}
}

func TestSelfClientConfig(t *testing.T) {
	ca := tlstest.NewCA(t, "ca")
	dir := t.TempDir()
	// Names that are not the loopback address the client dials.
	first := ca.Issue(t, "server", "osmo.example")
	files := first.Write(t, dir, "server", ca)
	var logs logtest.Buffer
	src := newSource(t, files, &logs)
	addr := serve(t, src)
	if _, err := call(t, addr, src.SelfClientConfig()); err != nil {
		t.Fatalf("the process's own server: %v", err)
	}
	// A certificate of the same CA, but not the Source's own.
	other := newSource(t, ca.Issue(t, "other").Write(t, t.TempDir(), "other", ca), &logs)
	if _, err := call(t, serve(t, other), src.SelfClientConfig()); err == nil || !strings.Contains(err.Error(), "own certificate") {
		t.Errorf("another server: %v, want refused", err)
	}
}

func TestLoadErrorsNameTheFlagAndFile(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "ca")
	files := ca.Issue(t, "server").Write(t, dir, "server", ca)
	otherKey := ca.Issue(t, "other").Write(t, t.TempDir(), "other", ca).Key
	garbage := filepath.Join(dir, "garbage.pem")
	tlstest.WriteFile(t, garbage, []byte("not PEM"))
	missing := filepath.Join(dir, "missing.pem")
	for _, tc := range []struct {
		name  string
		files Files
		want  []string
	}{
		{"no files", Files{}, []string{"no TLS files"}},
		{"cert without key", Files{Cert: files.Cert}, []string{"--tls-cert and --tls-key go together"}},
		{"missing cert", Files{Cert: missing, Key: files.Key}, []string{"--tls-cert " + missing, "no such file"}},
		{"missing key", Files{Cert: files.Cert, Key: missing}, []string{"--tls-key " + missing, "no such file"}},
		{"garbage cert", Files{Cert: garbage, Key: files.Key}, []string{"--tls-cert " + garbage, "--tls-key " + files.Key}},
		{"key of another cert", Files{Cert: files.Cert, Key: otherKey}, []string{"--tls-cert " + files.Cert, "--tls-key " + otherKey, "does not match"}},
		{"missing CA", Files{CA: missing}, []string{"--tls-ca " + missing, "no such file"}},
		{"garbage CA", Files{CA: garbage}, []string{"--tls-ca " + garbage, "no PEM certificate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.files, nil)
			if err == nil {
				t.Fatal("loaded")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}
