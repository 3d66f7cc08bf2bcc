package cli

import (
	"crypto/tls"
	"flag"
	"log/slog"
	"net/http"

	"google.golang.org/grpc"

	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/internal/tlsconfig"
)

// tlsFlags are --tls-cert, --tls-key and --tls-ca, the same for every
// command that serves or dials: with a certificate and key a server serves
// TLS and a client presents them; with a CA a client verifies servers
// against it and a server requires client certificates signed by it
// (mutual TLS). Without any, everything is plaintext, as before (a mesh may
// encrypt it). The files are read again as they change (see tlsconfig).
type tlsFlags struct {
	cert, key, ca string
	// src is what load made of the files; nil without any.
	src *tlsconfig.Source
}

// register adds the flags; each defaults to an environment variable, so a
// Kubernetes patch can set them without touching args (and osmo health, run
// as an exec probe, finds them in its container's environment).
func (f *tlsFlags) register(fs *flag.FlagSet, e *env) {
	fs.StringVar(&f.cert, "tls-cert", e.getenv("OSMO_TLS_CERT"), "serve TLS with the PEM certificate (chain) in `FILE`, and present it as a client; reloaded when it changes (env OSMO_TLS_CERT)")
	fs.StringVar(&f.key, "tls-key", e.getenv("OSMO_TLS_KEY"), "PEM private key `FILE` of --tls-cert, kept 0600 (env OSMO_TLS_KEY)")
	fs.StringVar(&f.ca, "tls-ca", e.getenv("OSMO_TLS_CA"), "verify servers against the PEM CA certificates in `FILE`; a TLS server then requires client certificates they signed: mutual TLS (env OSMO_TLS_CA)")
}

// load reads the files given, if any. serves says the command's only
// connections are to itself (osmo grader, osmo serve), where a CA without a
// certificate would verify nothing.
func (f *tlsFlags) load(log *slog.Logger, serves bool) error {
	if f.cert == "" && f.key == "" && f.ca == "" {
		return nil
	}
	if serves && f.cert == "" && f.key == "" {
		return usagef("--tls-ca needs --tls-cert and --tls-key here: it applies to the clients of a TLS server")
	}
	src, err := tlsconfig.New(tlsconfig.Files{Cert: f.cert, Key: f.key, CA: f.ca}, log)
	if err != nil {
		return usageError{err.Error()}
	}
	f.src = src
	return nil
}

// mutual reports whether the command's servers require client
// certificates: mutual TLS authenticates callers, as an API key does.
func (f *tlsFlags) mutual() bool {
	return f.src != nil && f.src.HasCert() && f.ca != ""
}

// serverOptions are a gRPC server's transport credentials (none: plaintext).
func (f *tlsFlags) serverOptions() []grpc.ServerOption {
	if f.src == nil || !f.src.HasCert() {
		return nil
	}
	return []grpc.ServerOption{grpc.Creds(f.src.ServerCredentials())}
}

// dialOptions are a gRPC client's transport credentials (none: plaintext).
// The server's name is the target's host (a dns:///host:port target's
// host), which its certificate must carry.
func (f *tlsFlags) dialOptions() []grpc.DialOption {
	if f.src == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(f.src.ClientCredentials())}
}

// loopbackDialOptions are the credentials of osmo serve's connections to
// its own gRPC servers over loopback. They trust exactly the certificate
// this process serves (tlsconfig.SelfClientConfig) rather than checking a
// name against a CA: the certificate is made for the names clients outside
// use, which 127.0.0.1 rarely is, and no CA may have been given. The
// certificate is presented as the client's too, so mutual TLS lets them in.
func (f *tlsFlags) loopbackDialOptions() []grpc.DialOption {
	if f.src == nil || !f.src.HasCert() {
		return nil
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(f.src.SelfCredentials())}
}

// httpServer is server.NewHTTP, or server.NewHTTPS with a certificate.
func (f *tlsFlags) httpServer(addr string, h http.Handler) (*server.HTTP, error) {
	if f.src == nil || !f.src.HasCert() {
		return server.NewHTTP(addr, h)
	}
	return server.NewHTTPS(addr, h, f.src.ServerConfig("h2", "http/1.1"))
}

// httpClientConfig is the TLS configuration of an HTTPS client (nil: Go's
// default).
func (f *tlsFlags) httpClientConfig() *tls.Config {
	if f.src == nil {
		return nil
	}
	return f.src.ClientConfig()
}
