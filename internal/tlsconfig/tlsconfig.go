// Package tlsconfig provides TLS configurations, for servers and clients,
// whose certificate, key and CA are read from PEM files and read again when
// those files change: cert-manager (or any rotation) replaces them on disk,
// and the next handshake uses the new ones without a restart.
//
// The files are checked on a handshake, at most once per check interval,
// not by a goroutine, so nothing has to be stopped. A file that does not
// load at a check (a rotation half done) keeps what was loaded last in use
// and logs a warning.
//
// Errors name a file by the flag that gives it (--tls-cert, --tls-key,
// --tls-ca), which is how every osmo command takes them.
package tlsconfig

import (
	"bytes"
	"cmp"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// DefaultCheckInterval is how often, at most, the files are read again.
const DefaultCheckInterval = time.Second

// minVersion is the oldest TLS version a peer may speak.
const minVersion = tls.VersionTLS12

// Files are the PEM files of an identity (a certificate chain and its key,
// which go together) and of the CA that verifies peers; either may be empty.
type Files struct {
	Cert, Key, CA string
}

// Source holds the identity and CA of Files, reloading them as the files
// change. It is safe for concurrent use.
type Source struct {
	files    Files
	log      *slog.Logger
	interval time.Duration
	now      func() time.Time

	mu      sync.Mutex
	checked time.Time
	pair    loadedPair
	ca      loadedCA
	// badPair, badCA failed to load last: warned about once, not per check.
	badPair, badCA []byte
}

type loadedPair struct {
	certPEM, keyPEM []byte
	cert            *tls.Certificate
	// previous is the leaf (DER) served before the last reload, which
	// SelfClientConfig still trusts for handshakes across the reload.
	previous []byte
}

type loadedCA struct {
	pem  []byte
	pool *x509.CertPool
}

// New loads files; one that does not load is an error here, and only a
// warning later. log may be nil.
func New(files Files, log *slog.Logger) (*Source, error) {
	if (files.Cert == "") != (files.Key == "") {
		return nil, errors.New("--tls-cert and --tls-key go together: give both or neither")
	}
	if files.Cert == "" && files.CA == "" {
		return nil, errors.New("no TLS files: give --tls-cert and --tls-key, --tls-ca, or all three")
	}
	log = cmp.Or(log, slog.New(slog.DiscardHandler))
	s := &Source{files: files, log: log, interval: DefaultCheckInterval, now: time.Now}
	if files.Cert != "" {
		certPEM, keyPEM, err := s.readPair()
		if err != nil {
			return nil, err
		}
		cert, err := s.parsePair(certPEM, keyPEM)
		if err != nil {
			return nil, err
		}
		s.pair = loadedPair{certPEM: certPEM, keyPEM: keyPEM, cert: cert}
		// A private key anyone on the machine can read is no secret; it
		// still works, so this is a warning (a Secret mounted with the
		// default mode 0644 is the usual cause).
		if fi, err := os.Stat(files.Key); err == nil && fi.Mode().Perm()&0o004 != 0 {
			log.Warn("the TLS private key is readable by every user; make it 0600 (or 0400)", "file", files.Key, "mode", fi.Mode().Perm().String())
		}
	}
	if files.CA != "" {
		caPEM, err := os.ReadFile(files.CA)
		if err != nil {
			return nil, fmt.Errorf("--tls-ca %s: %w", files.CA, err)
		}
		pool, err := s.parseCA(caPEM)
		if err != nil {
			return nil, err
		}
		s.ca = loadedCA{pem: caPEM, pool: pool}
	}
	s.checked = s.now()
	return s, nil
}

// HasCert reports whether the Source has an identity to serve or present.
func (s *Source) HasCert() bool { return s.files.Cert != "" }

// current checks the files if the interval has passed and returns what is
// in use.
func (s *Source) current() (loadedPair, loadedCA) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now := s.now(); now.Sub(s.checked) >= s.interval {
		s.checked = now
		s.reloadPair()
		s.reloadCA()
	}
	return s.pair, s.ca
}

func (s *Source) readPair() (certPEM, keyPEM []byte, err error) {
	if certPEM, err = os.ReadFile(s.files.Cert); err != nil {
		return nil, nil, fmt.Errorf("--tls-cert %s: %w", s.files.Cert, err)
	}
	if keyPEM, err = os.ReadFile(s.files.Key); err != nil {
		return nil, nil, fmt.Errorf("--tls-key %s: %w", s.files.Key, err)
	}
	return certPEM, keyPEM, nil
}

func (s *Source) parsePair(certPEM, keyPEM []byte) (*tls.Certificate, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert %s with --tls-key %s: %w", s.files.Cert, s.files.Key, err)
	}
	return &cert, nil
}

func (s *Source) parseCA(caPEM []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("--tls-ca %s: no PEM certificate in it", s.files.CA)
	}
	return pool, nil
}

// reloadPair loads the pair again if its files changed; s.mu is held.
func (s *Source) reloadPair() {
	if s.files.Cert == "" {
		return
	}
	certPEM, keyPEM, err := s.readPair()
	if err != nil {
		s.log.Warn("cannot read the TLS certificate; keeping the one loaded before", "err", err)
		return
	}
	if bytes.Equal(certPEM, s.pair.certPEM) && bytes.Equal(keyPEM, s.pair.keyPEM) {
		return
	}
	both := append(append([]byte{}, certPEM...), keyPEM...)
	cert, err := s.parsePair(certPEM, keyPEM)
	if err != nil {
		if !bytes.Equal(both, s.badPair) {
			s.badPair = both
			s.log.Warn("the TLS certificate changed but does not load (a rotation half done?); keeping the one loaded before", "err", err)
		}
		return
	}
	s.badPair = nil
	s.pair = loadedPair{certPEM: certPEM, keyPEM: keyPEM, cert: cert, previous: s.pair.cert.Certificate[0]}
	s.log.Info("reloaded the TLS certificate", "file", s.files.Cert, "serial", cert.Leaf.SerialNumber.String(), "not_after", cert.Leaf.NotAfter)
}

// reloadCA loads the CA again if its file changed; s.mu is held.
func (s *Source) reloadCA() {
	if s.files.CA == "" {
		return
	}
	caPEM, err := os.ReadFile(s.files.CA)
	if err != nil {
		s.log.Warn("cannot read the TLS CA; keeping the one loaded before", "err", fmt.Errorf("--tls-ca %s: %w", s.files.CA, err))
		return
	}
	if bytes.Equal(caPEM, s.ca.pem) {
		return
	}
	pool, err := s.parseCA(caPEM)
	if err != nil {
		if !bytes.Equal(caPEM, s.badCA) {
			s.badCA = caPEM
			s.log.Warn("the TLS CA changed but does not load; keeping the one loaded before", "err", err)
		}
		return
	}
	s.badCA = nil
	s.ca = loadedCA{pem: caPEM, pool: pool}
	s.log.Info("reloaded the TLS CA", "file", s.files.CA)
}

// ServerConfig is a server's configuration: it serves the current
// certificate and, with a CA, requires a client certificate signed by it.
// nextProtos are the ALPN protocols offered (gRPC adds h2 itself). The
// Source must have a certificate.
func (s *Source) ServerConfig(nextProtos ...string) *tls.Config {
	// GetConfigForClient, not GetCertificate: the client CAs rotate too.
	return &tls.Config{
		MinVersion: minVersion,
		NextProtos: nextProtos,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			pair, ca := s.current()
			cfg := &tls.Config{
				MinVersion:   minVersion,
				NextProtos:   nextProtos,
				Certificates: []tls.Certificate{*pair.cert},
			}
			if ca.pool != nil {
				cfg.ClientCAs = ca.pool
				cfg.ClientAuth = tls.RequireAndVerifyClientCert
			}
			return cfg, nil
		},
	}
}

// ClientConfig is one client connection's configuration, from what is
// current now: it verifies the server against the CA (else the system's
// roots) and presents the certificate, if any, when asked. The caller sets
// ServerName; make one per connection, so a rotated CA is used.
func (s *Source) ClientConfig() *tls.Config {
	_, ca := s.current()
	return &tls.Config{
		MinVersion:           minVersion,
		RootCAs:              ca.pool,
		GetClientCertificate: s.clientCertificate,
	}
}

func (s *Source) clientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	pair, _ := s.current()
	if pair.cert == nil {
		// No certificate: the server decides whether that is enough.
		return &tls.Certificate{}, nil
	}
	return pair.cert, nil
}

// SelfClientConfig is for a client, in this process, of a server of this
// Source (osmo serve's loopback connections): it trusts exactly the
// certificate the Source serves and presents it as its own.
func (s *Source) SelfClientConfig() *tls.Config {
	return &tls.Config{
		MinVersion: minVersion,
		// VerifyPeerCertificate accepts only the Source's own leaf, a
		// stronger check than a CA's for a peer known to be this process.
		InsecureSkipVerify: true, //nolint:gosec // see VerifyPeerCertificate
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			pair, _ := s.current()
			if len(raw) > 0 && pair.cert != nil &&
				(bytes.Equal(raw[0], pair.cert.Certificate[0]) || bytes.Equal(raw[0], pair.previous)) {
				return nil
			}
			return errors.New("tlsconfig: the loopback peer does not present this process's own certificate")
		},
		GetClientCertificate: s.clientCertificate,
	}
}
