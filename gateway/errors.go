package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// retryAfterSeconds is sent with every 429, as the Osmosis servers do when
// they are at capacity.
const retryAfterSeconds = "5"

// httpStatusFromCode is the one place gRPC codes become HTTP statuses:
// grpc-gateway's table, but where the Osmosis servers differ: bad input is
// 422 (FastAPI's validation status), and codes without a client-side
// meaning are 500.
func httpStatusFromCode(code codes.Code) int {
	switch code {
	case codes.InvalidArgument:
		return http.StatusUnprocessableEntity
	case codes.Aborted, codes.OutOfRange:
		return http.StatusInternalServerError
	}
	return runtime.HTTPStatusFromCode(code)
}

// writeRPCError is the grpc-gateway error handler of every failed REST call.
func (g *gateway) writeRPCError(ctx context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
	if body, ok := r.Body.(*limitedBody); ok && body.exceeded {
		g.writeBodyTooLarge(w, r)
		return
	}

	var httpErr *runtime.HTTPStatusError
	var st *status.Status
	code := 0
	if errors.As(err, &httpErr) {
		// grpc-gateway's own request errors carry their HTTP status.
		st = status.Convert(httpErr.Err)
		code = httpErr.HTTPStatus
	} else {
		st = status.Convert(err)
		code = httpStatusFromCode(st.Code())
	}

	h := w.Header()
	switch code {
	case http.StatusTooManyRequests:
		h.Set("Retry-After", retryAfterSeconds)
	case http.StatusUnauthorized:
		h.Set("WWW-Authenticate", "Bearer")
	}

	method, _ := runtime.RPCMethod(ctx)
	attrs := append(requestAttrs(r.Header),
		slog.String("rpc", method),
		slog.String("code", st.Code().String()),
		slog.Int("http_status", code),
		slog.String("error", st.Message()),
	)
	g.log.LogAttrs(ctx, levelForStatus(code), "gateway: REST call failed", attrs...)

	writeDetail(w, code, st.Message())
}

// writeRoutingError answers a path no route matches (404) or a method the
// path does not take (405), with FastAPI's texts.
func (g *gateway) writeRoutingError(_ context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, _ *http.Request, code int) {
	writeDetail(w, code, http.StatusText(code))
}

func (g *gateway) writeBodyTooLarge(w http.ResponseWriter, r *http.Request) {
	g.log.LogAttrs(r.Context(), slog.LevelDebug, "gateway: request body too large",
		append(requestAttrs(r.Header), slog.String("path", r.URL.Path), slog.Int64("limit_bytes", g.maxBody))...)
	// The rest of the body is not read: an HTTP/1 client must open a new
	// connection (HTTP/2 resets just the stream).
	if r.ProtoMajor == 1 {
		w.Header().Set("Connection", "close")
	}
	writeDetail(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", g.maxBody))
}

// writeDetail writes the FastAPI error body {"detail": "..."}.
func writeDetail(w http.ResponseWriter, code int, detail string) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	// Keep <, > and & readable, as Python's json.dumps does.
	enc.SetEscapeHTML(false)
	_ = enc.Encode(struct { // a string always encodes
		Detail string `json:"detail"`
	}{detail})
	body := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))

	h := w.Header()
	// A streaming response that failed may have announced trailers.
	h.Del("Trailer")
	h.Del("Transfer-Encoding")
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(code)
	_, _ = w.Write(body)
}

// levelForStatus logs server failures (5xx) as warnings, the caller's
// mistakes at debug level.
func levelForStatus(httpStatus int) slog.Level {
	if httpStatus >= http.StatusInternalServerError {
		return slog.LevelWarn
	}
	return slog.LevelDebug
}

// requestAttrs are the rollout and sample ids a request names in its headers.
func requestAttrs(h http.Header) []slog.Attr {
	var attrs []slog.Attr
	if v := h.Get("X-Rollout-Id"); v != "" {
		attrs = append(attrs, slog.String("rollout_id", v))
	}
	if v := h.Get("X-Sample-Id"); v != "" {
		attrs = append(attrs, slog.String("sample_id", v))
	}
	return attrs
}
