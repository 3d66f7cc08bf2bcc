package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/osmo-rl/osmo/internal/eval"
	"github.com/osmo-rl/osmo/internal/server"
)

// secretVar registers a string flag defaulting to def whose value never
// shows in usage text: a default read from the environment (OSMO_API_KEY)
// would otherwise land on the terminal at every -h and mistyped flag.
func secretVar(fs *flag.FlagSet, p *string, name, def, usage string) {
	*p = def
	fs.Func(name, usage, func(v string) error {
		*p = v
		return nil
	})
}

// checkListen refuses to serve without authentication beyond loopback: a
// service that runs agents and makes requests on a caller's behalf is not
// left open to a network by a forgotten flag. With --insecure it logs a
// warning instead, at every start.
func (f *serviceFlags) checkListen(ctx context.Context, log *slog.Logger, cmd string, listens ...listenAddr) error {
	// Servers that require client certificates authenticate their callers
	// as an API key does.
	if f.apiKey != "" || (f.tls.src != nil && f.tls.src.HasCert() && f.tls.ca != "") {
		return nil
	}
	var open []string
	for _, l := range listens {
		if l.addr != "" && !loopbackAddr(ctx, l.addr) {
			open = append(open, l.flag+" "+l.addr)
		}
	}
	if len(open) == 0 {
		return nil
	}
	if f.insecure {
		log.Warn("serving WITHOUT authentication beyond loopback (--insecure): anyone who reaches these addresses can start rollouts",
			"listen", strings.Join(open, ", "))
		return nil
	}
	return usagef("%s: %s reaches beyond this machine and no --api-key is set: pass --api-key KEY (or env OSMO_API_KEY), "+
		"require client certificates (--tls-cert, --tls-key and --tls-ca), listen on loopback (127.0.0.1), "+
		"or pass --insecure to serve without authentication on purpose", cmd, strings.Join(open, ", "))
}

// listenAddr is an address a command listens on and the flag that sets it.
type listenAddr struct{ flag, addr string }

// loopbackAddr reports whether addr (host:port) listens on loopback only.
// An empty host listens on every interface. A name counts as loopback when
// every address it resolves to is loopback ("localhost" always is).
func loopbackAddr(ctx context.Context, addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	if host == "" {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	if ip := net.ParseIP(strings.Trim(host, "[]")); ip != nil {
		return ip.IsLoopback()
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil || len(ips) == 0 {
		return false
	}
	for _, ip := range ips {
		if !ip.IP.IsLoopback() {
			return false
		}
	}
	return true
}

// requireKeyHTTP puts the bearer check of key in front of h for every path
// but /health, in the Osmosis 401 shape; an empty key lets everything
// through. It guards what an HTTP port serves besides the gateway's RPCs
// (whose keys the services check), such as /metrics.
func requireKeyHTTP(key string, h http.Handler) http.Handler {
	if key == "" {
		return h
	}
	auth := server.NewBearerAuth(key)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" || auth.Check(r.Header.Values("Authorization")) {
			h.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("WWW-Authenticate", "Bearer")
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprintf(w, "{\"detail\":%q}\n", server.AuthMessage)
	})
}

// newMetricsRegistry is one process's Prometheus registry, with the Go
// runtime and process collectors every service exposes.
func newMetricsRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// withMetrics serves GET /metrics from reg in front of h, behind key when
// one is set (a port that also serves the API); a metrics-only address is
// left open.
func withMetrics(h http.Handler, reg *prometheus.Registry, key string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", requireKeyHTTP(key, promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})))
	mux.Handle("/", h)
	return mux
}

// metricsServer serves /metrics on its own address, for the gRPC-only
// services; with an empty addr, run only waits for ctx.
func metricsServer(addr string, reg *prometheus.Registry) (func(ctx context.Context) error, string, error) {
	if addr == "" {
		return func(ctx context.Context) error { <-ctx.Done(); return nil }, "", nil
	}
	srv, err := server.NewHTTP(addr, withMetrics(http.NotFoundHandler(), reg, ""))
	if err != nil {
		return nil, "", err
	}
	return srv.Serve, srv.URL(), nil
}

// addrFile is --addr-file: a server started on port 0 tells whoever
// started it where it listens by writing its addresses there once every
// listener is open, whatever the log level.
type addrFile string

func (a *addrFile) register(fs *flag.FlagSet) {
	fs.StringVar((*string)(a), "addr-file", "", "once listening, write the bound addresses to `FILE` as a JSON object (the keys of the \"serving\" log line); with port 0, how a caller learns the ports")
}

// write writes the addresses, given as key, value pairs, to the file (if
// named), whole by a rename, so a reader never sees half of it.
func (a addrFile) write(kv ...string) error {
	if a == "" {
		return nil
	}
	m := make(map[string]string, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := eval.WriteFileAtomic(string(a), append(b, '\n')); err != nil {
		return fmt.Errorf("--addr-file: %w", err)
	}
	return nil
}
