package rollout

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
)

// TestStreamScan: a body written in pieces of every size, the token
// anywhere (across pieces too), is found as in the body whole.
func TestStreamScan(t *testing.T) {
	for _, body := range []string{
		`{"model":"m","stream":true}`,
		`"stream"`,
		`{"model":"m","messages":[{"role":"user","content":"stream"}]}`,
		`{"model":"m","messages":[]}`,
		`{"stream_options":{}}`,
		`"strea`,
		``,
		`""stream""`,
	} {
		want := strings.Contains(body, streamToken)
		for size := 1; size <= len(body)+1; size++ {
			var scan streamScan
			for rest := []byte(body); len(rest) > 0; {
				n := min(size, len(rest))
				if _, err := scan.Write(rest[:n]); err != nil {
					t.Fatal(err)
				}
				rest = rest[n:]
			}
			if scan.found != want {
				t.Errorf("%q in pieces of %d: found %v, want %v", body, size, scan.found, want)
			}
		}
	}
}

// TestNotStreamed: a request's body is read for "stream" whether it can
// write itself out (bytes) or is only read, one byte at a time here.
func TestNotStreamed(t *testing.T) {
	for body, want := range map[string]bool{
		`{"model":"m","stream":true}`: false,
		`{"model":"m","messages":[]}`: true,
	} {
		req, err := http.NewRequest(http.MethodPost, "http://policy/v1/chat/completions", bytes.NewReader([]byte(body)))
		if err != nil {
			t.Fatal(err)
		}
		if got := notStreamed(req); got != want {
			t.Errorf("%s from bytes: notStreamed %v, want %v", body, got, want)
		}
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(iotest.OneByteReader(strings.NewReader(body))), nil }
		if got := notStreamed(req); got != want {
			t.Errorf("%s read a byte at a time: notStreamed %v, want %v", body, got, want)
		}
	}
	req, _ := http.NewRequest(http.MethodPost, "http://policy/v1/chat/completions", nil)
	if notStreamed(req) {
		t.Error("a request without a body to read again was taken as not streamed")
	}
}
