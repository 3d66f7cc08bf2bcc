package inproc_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/inproc"
)

func client(h http.Handler) *http.Client {
	return &http.Client{Transport: inproc.Transport{Handler: h}}
}

func TestRoundTrip(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Echo", r.Header.Get("X-In")+" "+r.Method+" "+r.URL.Path+" "+r.Host)
		w.WriteHeader(http.StatusTeapot)
		_, _ = w.Write(append([]byte("got "), b...))
		w.Header().Set("X-Late", "ignored") // after the header went out
	})
	req, _ := http.NewRequest(http.MethodPost, "http://proxy.invalid/v1/x?q=1", strings.NewReader("body"))
	req.Header.Set("X-In", "hi")
	resp, err := client(h).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusTeapot || string(b) != "got body" || resp.Header.Get("X-Echo") != "hi POST /v1/x proxy.invalid" || resp.Header.Get("X-Late") != "" {
		t.Fatalf("%d %q %v", resp.StatusCode, b, resp.Header)
	}
}

// TestStreams: each flushed write reaches the client before the handler
// writes the next, as server-sent events must.
func TestStreams(t *testing.T) {
	next := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			_, _ = io.WriteString(w, "data: "+string(rune('a'+i))+"\n\n")
			http.NewResponseController(w).Flush()
			<-next
		}
	})
	resp, err := client(h).Get("http://x/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := rd.ReadString('\n')
		if err != nil || line != "data: "+string(rune('a'+i))+"\n" {
			t.Fatalf("event %d: %q %v", i, line, err)
		}
		_, _ = rd.ReadString('\n')
		next <- struct{}{}
	}
}

// TestCancellation: a client that gives up (its context, or closing the
// body) ends the handler's context, as closing a connection does.
func TestCancellation(t *testing.T) {
	ended := make(chan error, 2)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/after-header" {
			w.WriteHeader(http.StatusOK)
		}
		<-r.Context().Done()
		ended <- context.Cause(r.Context())
	})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://x/before-header", nil)
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	if _, err := client(h).Do(req); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context did not end with the client's")
	}
	resp, err := client(h).Get("http://x/after-header")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	select {
	case cause := <-ended:
		if cause == nil {
			t.Error("no cause")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("closing the body did not end the handler's context")
	}
}

func TestHandlerPanicsAndEmptyAnswers(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/panic":
			panic("boom")
		case "/panic-mid-body":
			_, _ = io.WriteString(w, "partial")
			panic("boom")
		}
		// nothing written: an empty 200
	})
	if _, err := client(h).Get("http://x/panic"); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("panic before the header: %v", err)
	}
	resp, err := client(h).Get("http://x/panic-mid-body")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Error("a body cut by a panic read without error")
	}
	_ = resp.Body.Close()
	resp, err = client(h).Get("http://x/empty")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != 200 || len(b) != 0 || err != nil {
		t.Errorf("empty answer: %d %q %v", resp.StatusCode, b, err)
	}
}

func TestConcurrent(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		_, _ = w.Write(b)
	})
	c := client(h)
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := strings.Repeat(string(rune('a'+i%26)), 100_000)
			resp, err := c.Post("http://x/", "text/plain", strings.NewReader(msg))
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			if b, _ := io.ReadAll(resp.Body); string(b) != msg {
				t.Errorf("request %d: got %d bytes back", i, len(b))
			}
		}()
	}
	wg.Wait()
}

func TestWhole(t *testing.T) {
	var goroutine bool
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/panic" {
			panic("boom")
		}
		w.Header().Set("X-A", "1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "part 1, ")
		http.NewResponseController(w).Flush()
		_, _ = io.WriteString(w, "part 2")
		goroutine = true // written from the caller's goroutine: no race
	})
	c := &http.Client{Transport: inproc.Transport{Handler: h, Whole: func(*http.Request) bool { return true }}}
	resp, err := c.Get("http://x/whole")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || string(b) != "part 1, part 2" || resp.Header.Get("X-A") != "1" || resp.ContentLength != 14 || !goroutine {
		t.Fatalf("%d %q %v %d", resp.StatusCode, b, resp.Header, resp.ContentLength)
	}
	if _, err := c.Get("http://x/panic"); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("panic: %v", err)
	}
}
