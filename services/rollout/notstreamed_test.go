package rollout

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
)

// TestNotStreamed: a request's body is read for "stream" whether it can
// write itself out (bytes) or is only read, one byte at a time here; a
// body that holds the token anywhere is taken as streamed.
func TestNotStreamed(t *testing.T) {
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
		want := !strings.Contains(body, `"stream"`)
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
