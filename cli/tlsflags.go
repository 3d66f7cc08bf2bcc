package cli

import (
	"flag"
	"log/slog"
	"net/http"

	"google.golang.org/grpc"

	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/internal/tlsconfig"
)

// tlsFlags are --tls-cert, --tls-key and --tls-ca of every command that
// serves or dials: with a certificate and key a server serves TLS and a
// client presents them; with a CA a client verifies servers against it and
// a server requires client certificates signed by it (mutual TLS). Without
// any, everything is plaintext (a mesh may encrypt it).
type tlsFlags struct {
	cert, key, ca string
	src           *tlsconfig.Source // nil without any file
}

// register adds the flags; each defaults to an environment variable, so a
// Kubernetes patch can set them without touching args (and osmo health, as
// an exec probe, finds them).
func (f *tlsFlags) register(fs *flag.FlagSet, e *env) {
	fs.StringVar(&f.cert, "tls-cert", e.getenv("OSMO_TLS_CERT"), "serve TLS with the PEM certificate (chain) in `FILE`, and present it as a client; reloaded when it changes (env OSMO_TLS_CERT)")
	fs.StringVar(&f.key, "tls-key", e.getenv("OSMO_TLS_KEY"), "PEM private key `FILE` of --tls-cert, kept 0600 (env OSMO_TLS_KEY)")
	fs.StringVar(&f.ca, "tls-ca", e.getenv("OSMO_TLS_CA"), "verify servers against the PEM CA certificates in `FILE`; a TLS server then requires client certificates they signed: mutual TLS (env OSMO_TLS_CA)")
}

// load reads the files given, if any. serves says the command's only
// connections are to itself (grader, serve), where a CA without a
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

// dialOptions are a gRPC client's transport credentials (none: plaintext);
// the server's certificate must carry the target's host.
func (f *tlsFlags) dialOptions() []grpc.DialOption {
	if f.src == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(f.src.ClientCredentials())}
}

// loopbackDialOptions are the credentials of osmo serve's connections to
// its own gRPC servers. They trust exactly the certificate this process
// serves, as it is made for the names outside clients use (rarely
// 127.0.0.1) and no CA may be given; presented as the client's too, it
// passes mutual TLS.
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
