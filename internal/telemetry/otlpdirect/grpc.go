package otlpdirect

import (
	"context"
	"crypto/tls"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/gzip" // registers the gzip compressor
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// exportMethod is the OTLP trace service's only method.
const exportMethod = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

// GRPCConfig configures an OTLP/gRPC exporter.
type GRPCConfig struct {
	// Target is the collector's host:port.
	Target string
	// Insecure sends in plaintext; otherwise TLS (nil: the system's
	// roots).
	Insecure bool
	TLS      *tls.Config
	// Headers are sent as metadata with every export.
	Headers map[string]string
	// Gzip compresses the requests.
	Gzip bool
	// Timeout bounds one attempt (10s).
	Timeout time.Duration
	Retry   RetryConfig
}

// GRPCExporter calls TraceService/Export with the encoded request as the
// message, through a codec that passes bytes as they are.
type GRPCExporter struct {
	cfg  GRPCConfig
	conn *grpc.ClientConn
	md   metadata.MD
	opts []grpc.CallOption
}

// NewGRPCExporter makes an OTLP/gRPC exporter; it connects on the first
// export.
func NewGRPCExporter(cfg GRPCConfig) (*GRPCExporter, error) {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	cfg.Retry = cfg.Retry.withDefaults()
	creds := insecure.NewCredentials()
	if !cfg.Insecure {
		tc := cfg.TLS
		if tc == nil {
			tc = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		creds = credentials.NewTLS(tc)
	}
	conn, err := grpc.NewClient(cfg.Target, grpc.WithTransportCredentials(creds), grpc.WithUserAgent(userAgent))
	if err != nil {
		return nil, fmt.Errorf("otlpdirect: OTLP/gRPC %s: %w", cfg.Target, err)
	}
	e := &GRPCExporter{cfg: cfg, conn: conn, md: metadata.New(cfg.Headers),
		opts: []grpc.CallOption{grpc.ForceCodecV2(rawCodec{})}}
	if cfg.Gzip {
		e.opts = append(e.opts, grpc.UseCompressor("gzip"))
	}
	return e, nil
}

// Export sends request, retrying the codes the OTLP specification calls
// retryable (ResourceExhausted only when the collector sent RetryInfo).
func (e *GRPCExporter) Export(ctx context.Context, request []byte) error {
	if len(e.md) > 0 {
		ctx = metadata.NewOutgoingContext(ctx, e.md)
	}
	return withRetries(ctx, e.cfg.Retry, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, e.cfg.Timeout)
		defer cancel()
		var resp []byte
		err := e.conn.Invoke(ctx, exportMethod, &request, &resp, e.opts...)
		if err == nil {
			return partialSuccess(resp)
		}
		return grpcRetryable(err)
	})
}

func grpcRetryable(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	var wait time.Duration
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.RetryDelay != nil {
			wait = ri.RetryDelay.AsDuration()
		}
	}
	switch st.Code() {
	case codes.Canceled, codes.DeadlineExceeded, codes.Aborted, codes.OutOfRange, codes.Unavailable, codes.DataLoss:
		return &retryable{err: err, wait: wait}
	case codes.ResourceExhausted:
		if wait > 0 {
			return &retryable{err: err, wait: wait}
		}
	}
	return err
}

// Shutdown closes the connection.
func (e *GRPCExporter) Shutdown(context.Context) error { return e.conn.Close() }

// rawCodec sends a *[]byte as the message and reads the answer into one.
// Its name is "proto": what it carries is protobuf, encoded already.
type rawCodec struct{}

var _ encoding.CodecV2 = rawCodec{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	p, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("otlpdirect: raw codec cannot marshal %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(*p)}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	p, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("otlpdirect: raw codec cannot unmarshal into %T", v)
	}
	*p = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }
