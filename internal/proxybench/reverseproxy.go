package proxybench

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"time"

	"github.com/osmo-rl/osmo/internal/server"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// ServeReverseProxy serves a plain httputil.ReverseProxy to upstream (a base
// URL: each request's path is appended to it) on addr until ctx ends: the
// process MeasureOneCore compares the proxy with. It forwards with
// llmproxy.DefaultTransport, as the proxy does, and records nothing.
func ServeReverseProxy(ctx context.Context, addr, upstream string) error {
	target, err := url.Parse(upstream)
	if err != nil || target.Scheme == "" || target.Host == "" {
		return fmt.Errorf("proxybench: upstream %q is not an absolute URL", upstream)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	tr := llmproxy.DefaultTransport()
	defer tr.CloseIdleConnections()
	srv := &http.Server{Handler: newReverseProxy(target, tr), ReadHeaderTimeout: 10 * time.Second}
	return server.ServeHTTP(ctx, srv, ln, 5*time.Second)
}

// newReverseProxy forwards every request to target through tr.
func newReverseProxy(target *url.URL, tr http.RoundTripper) *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite:   func(pr *httputil.ProxyRequest) { pr.SetURL(target) },
		Transport: tr,
		// The clients of a measurement hang up when it ends, cancelling
		// the requests in flight: nothing to report.
		ErrorLog: log.New(io.Discard, "", 0),
	}
}
