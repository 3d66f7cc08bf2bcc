// Package inproc serves HTTP requests with a handler in the same process,
// without sockets: a client whose Transport is an inproc.Transport reaches
// the handler as if over a connection (the handler sees the request, its
// context ends when the client gives up or closes the answer, the answer
// streams back as it is written and flushed), for the cost of a goroutine
// and a pipe instead of two file descriptors and a TCP round trip.
package inproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
)

// Transport is an http.RoundTripper that serves every request with
// Handler. The request's URL host is not used.
type Transport struct {
	Handler http.Handler
	// Whole, when set and true for a request, serves it in the caller's
	// goroutine and answers once the handler returned, its body buffered:
	// no goroutine and no pipe, for requests whose answer is not a stream
	// the client reads as it comes.
	Whole func(*http.Request) bool
}

// RoundTrip serves req and returns the answer once the handler has written
// its header (or returned). The body streams: each Write reaches the
// client when it reads, so a server-sent event is not held back (unless
// Whole says the request wants it whole).
func (t Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.Whole != nil && t.Whole(req) {
		return t.whole(req)
	}
	ctx, cancel := context.WithCancelCause(req.Context())
	sreq := serverRequest(req, ctx)
	pr, pw := io.Pipe()
	w := &writer{header: http.Header{}, pipe: pw, ready: make(chan struct{})}
	go func() {
		defer func() {
			if p := recover(); p != nil {
				err := fmt.Errorf("inproc: handler panicked: %v", p)
				if p == http.ErrAbortHandler {
					err = errors.New("inproc: handler aborted the response")
				}
				w.fail(err)
				return
			}
			w.finish()
		}()
		t.Handler.ServeHTTP(w, sreq)
	}()
	select {
	case <-w.ready:
	case <-ctx.Done():
		cancel(nil)
		_ = pr.CloseWithError(ctx.Err())
		return nil, ctx.Err()
	}
	if w.err != nil {
		cancel(w.err)
		return nil, w.err
	}
	return response(req, w.code, w.sent, &body{PipeReader: pr, cancel: cancel}, -1), nil
}

// response is the handler's answer to req as a client receives it; length
// is -1 when unknown (a stream).
func response(req *http.Request, code int, h http.Header, b io.ReadCloser, length int64) *http.Response {
	return &http.Response{
		Status:        fmt.Sprintf("%d %s", code, http.StatusText(code)),
		StatusCode:    code,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          b,
		ContentLength: length,
		Request:       req,
	}
}

// serverRequest is req as a server would see it, under ctx. The header is
// shared, not copied: a handler reads its request's header.
func serverRequest(req *http.Request, ctx context.Context) *http.Request {
	sreq := req.WithContext(ctx)
	sreq.RequestURI = req.URL.RequestURI()
	sreq.RemoteAddr = "inproc"
	if sreq.Body == nil {
		sreq.Body = http.NoBody
	}
	if sreq.Host == "" {
		sreq.Host = req.URL.Host
	}
	return sreq
}

// whole serves req in this goroutine, buffering the answer.
func (t Transport) whole(req *http.Request) (resp *http.Response, err error) {
	w := &buffered{header: http.Header{}}
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("inproc: handler panicked: %v", p)
			}
		}()
		t.Handler.ServeHTTP(w, serverRequest(req, req.Context()))
	}()
	if err != nil {
		return nil, err
	}
	w.WriteHeader(http.StatusOK)
	return response(req, w.code, w.sent, io.NopCloser(bytes.NewReader(w.body.Bytes())), int64(w.body.Len())), nil
}

// buffered is the handler's http.ResponseWriter of a whole answer.
type buffered struct {
	header http.Header
	code   int
	sent   http.Header
	body   bytes.Buffer
}

func (w *buffered) Header() http.Header { return w.header }

func (w *buffered) WriteHeader(code int) {
	if w.code == 0 && code >= 200 {
		w.code, w.sent = code, w.header.Clone()
	}
}

func (w *buffered) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.body.Write(p)
}

// Flush does nothing: the client gets the answer when the handler returns.
func (w *buffered) Flush() { w.WriteHeader(http.StatusOK) }

// body is the answer's body: closing it ends the handler's context, as a
// client closing its connection would.
type body struct {
	*io.PipeReader
	cancel context.CancelCauseFunc
}

// errClientClosed is the cause of a handler's context ended because the
// client closed the answer.
var errClientClosed = errors.New("inproc: the client closed the response body")

func (b *body) Close() error {
	b.cancel(errClientClosed)
	return b.PipeReader.CloseWithError(errClientClosed)
}

// writer is the handler's http.ResponseWriter.
type writer struct {
	header http.Header
	pipe   *io.PipeWriter

	once  sync.Once
	ready chan struct{} // closed when the header is sent (or the handler failed)
	code  int
	sent  http.Header // the header as sent: later changes do not reach the client
	err   error       // the handler failed before sending anything
}

func (w *writer) Header() http.Header { return w.header }

func (w *writer) WriteHeader(code int) {
	if code >= 100 && code < 200 {
		return // informational answers are not relayed
	}
	w.once.Do(func() {
		w.code, w.sent = code, w.header.Clone()
		close(w.ready)
	})
}

func (w *writer) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.pipe.Write(p)
}

// Flush is a no-op: a Write is in the client's hands when it returns.
func (w *writer) Flush() { w.WriteHeader(http.StatusOK) }

// finish ends the answer once the handler returned.
func (w *writer) finish() {
	w.WriteHeader(http.StatusOK)
	_ = w.pipe.Close()
}

// fail ends the answer with err: before the header the round trip fails,
// after it the body does.
func (w *writer) fail(err error) {
	w.once.Do(func() {
		w.err = err
		close(w.ready)
	})
	_ = w.pipe.CloseWithError(err)
}
