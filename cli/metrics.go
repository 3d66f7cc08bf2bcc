package cli

import (
	"context"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/osmo-rl/osmo/internal/server"
)

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
