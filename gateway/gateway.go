// Package gateway is the HTTP face of the rollout and grader services. One
// handler serves:
//
//   - the REST paths of the Osmosis protocols (POST /v1/rollout/init,
//     GET /health, ...) through grpc-gateway, with FastAPI-style error bodies
//     ({"detail": "..."}) that Osmosis clients parse;
//   - Connect, gRPC and gRPC-Web for both services through connect-go, plus
//     gRPC server reflection and grpc.health.v1.Health/Check;
//   - GET /openapi.json, the OpenAPI document of the REST surface.
//
// The gateway keeps no state: every call is forwarded to the services over
// the connections in Config. To accept gRPC without TLS, serve the handler
// with an http.Server whose Protocols enable unencrypted HTTP/2.
//
// REST JSON uses the proto field names (the Osmosis wire names) and emits
// every field but unset proto3 optional ones; the G3 status body sends
// those as null, since its wire shape lists every key.
package gateway

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo/gen/openapi"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// DefaultMaxBodyBytes is the request body limit used when
// Config.MaxBodyBytes is zero.
const DefaultMaxBodyBytes int64 = 32 << 20

// Config configures New.
type Config struct {
	// Rollout is the connection to the rollout service. Required.
	Rollout grpc.ClientConnInterface
	// Grader is the connection to the grader service. Nil means the grader
	// is not deployed behind this gateway: its routes answer 503 (REST) or
	// Unavailable (Connect, gRPC).
	Grader grpc.ClientConnInterface
	// MaxBodyBytes bounds a REST request body and each Connect or gRPC
	// request message. Zero means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// Logger receives one record per failed call (slog.Default() if nil).
	Logger *slog.Logger
	// TracerProvider, when set, traces every request: an HTTP server span
	// that continues the caller's trace, with the rollout id of a start on
	// it and in the baggage of the call. Instrument the connections in
	// Rollout and Grader for the calls' own spans.
	TracerProvider trace.TracerProvider
	// Propagator reads the caller's trace context (W3C trace context and
	// baggage when nil).
	Propagator propagation.TextMapPropagator
}

// New returns the gateway handler for cfg.
func New(cfg Config) (http.Handler, error) {
	if cfg.Rollout == nil {
		return nil, errors.New("gateway.New: Config.Rollout is required")
	}
	if cfg.MaxBodyBytes < 0 {
		return nil, fmt.Errorf("gateway.New: Config.MaxBodyBytes must not be negative, got %d", cfg.MaxBodyBytes)
	}
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	graderConn := cfg.Grader
	if graderConn == nil {
		graderConn = unavailableConn{}
	}

	rolloutConn := cfg.Rollout
	if cfg.TracerProvider != nil {
		rolloutConn = rolloutIDConn{rolloutConn}
	}
	g := &gateway{maxBody: cfg.MaxBodyBytes, log: cfg.Logger.With("component", "gateway")}
	rest, err := g.newREST(rolloutConn, graderConn)
	if err != nil {
		return nil, err
	}
	g.rest = rest
	if g.rpc, err = g.newRPCRoutes(rolloutConn, graderConn); err != nil {
		return nil, err
	}
	g.openapi = openapi.JSON()
	if cfg.TracerProvider == nil {
		return g, nil
	}
	return traced(g, cfg.TracerProvider, cfg.Propagator), nil
}

// gateway routes a request to the Connect handlers (by path prefix), the
// OpenAPI document, or the REST mux.
type gateway struct {
	maxBody int64
	log     *slog.Logger
	rpc     []rpcRoute
	rest    *runtime.ServeMux
	openapi []byte
}

// rpcRoute is a Connect handler and the path prefix it owns.
type rpcRoute struct {
	prefix  string
	handler http.Handler
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	path := r.URL.Path
	for _, rt := range g.rpc {
		if strings.HasPrefix(path, rt.prefix) {
			rt.handler.ServeHTTP(w, r)
			return
		}
	}
	if path == "/openapi.json" {
		g.serveOpenAPI(w, r)
		return
	}
	g.serveREST(w, r)
}

func (g *gateway) newREST(rollout, grader grpc.ClientConnInterface) (*runtime.ServeMux, error) {
	marshaler := newJSONMarshaler()
	mux := runtime.NewServeMux(
		runtime.WithMarshalerOption(runtime.MIMEWildcard, marshaler),
		runtime.WithErrorHandler(g.writeRPCError),
		runtime.WithRoutingErrorHandler(g.writeRoutingError),
		runtime.WithIncomingHeaderMatcher(incomingHeader),
		// Service metadata stays internal.
		runtime.WithOutgoingHeaderMatcher(dropHeader),
		runtime.WithOutgoingTrailerMatcher(dropHeader),
		runtime.WithForwardResponseOption(acceptInitRollout),
		runtime.WithForwardResponseOption(rowsHeaders),
		runtime.WithForwardResponseRewriter(plainRows(marshaler)),
	)
	// The context is only for connections they would dial themselves.
	ctx := context.Background()
	if err := rolloutv1.RegisterRolloutServiceHandlerClient(ctx, mux, restRolloutClient{rolloutv1.NewRolloutServiceClient(rollout)}); err != nil {
		return nil, fmt.Errorf("gateway.New: rollout REST routes: %w", err)
	}
	if err := graderv1.RegisterGraderServiceHandlerClient(ctx, mux, graderv1.NewGraderServiceClient(grader)); err != nil {
		return nil, fmt.Errorf("gateway.New: grader REST routes: %w", err)
	}
	return mux, nil
}

// serveREST bounds the body and hands the request to grpc-gateway.
func (g *gateway) serveREST(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength > g.maxBody {
		g.writeBodyTooLarge(w, r)
		return
	}
	r.Body = &limitedBody{ReadCloser: http.MaxBytesReader(w, r.Body, g.maxBody)}
	if r.URL.Path == rowsStreamPath {
		w = &headerOnce{ResponseWriter: w}
	}
	g.rest.ServeHTTP(w, r)
}

func (g *gateway) serveOpenAPI(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeDetail(w, http.StatusMethodNotAllowed, http.StatusText(http.StatusMethodNotAllowed))
		return
	}
	http.ServeContent(w, r, "openapi.json", time.Time{}, bytes.NewReader(g.openapi))
}

// acceptInitRollout makes InitRollout and StartRollout answer 202 Accepted,
// as the Osmosis protocols require. It runs before their answer is
// marshaled, which cannot fail: an init's tools were checked when made.
func acceptInitRollout(ctx context.Context, w http.ResponseWriter, _ proto.Message) error {
	method, ok := runtime.RPCMethod(ctx)
	if !ok || (method != rolloutv1.RolloutService_InitRollout_FullMethodName && method != rolloutv1.RolloutService_StartRollout_FullMethodName) {
		return nil
	}
	w.WriteHeader(http.StatusAccepted)
	return nil
}

// limitedBody records that the body went over the limit, so the error
// handler can answer 413 (grpc-gateway makes it InvalidArgument).
type limitedBody struct {
	io.ReadCloser
	exceeded bool
}

func (b *limitedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		b.exceeded = true
	}
	return n, err
}
