package mockllm_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/internal/mockllm"
)

var sixTimesSeven = []any{map[string]any{"role": "user", "content": "What is 6 times 7?"}}

// sseStream is an open streamed chat completion, read event by event.
type sseStream struct {
	resp *http.Response
	sc   *bufio.Scanner
}

func openStream(t *testing.T, ctx context.Context, base string) *sseStream {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"stream": true, "messages": sixTimesSeven})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("opening the stream: %v", err)
	}
	t.Cleanup(func() { _ = resp.Body.Close() })
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stream status %d", resp.StatusCode)
	}
	return &sseStream{resp: resp, sc: bufio.NewScanner(resp.Body)}
}

// next is the next event's data ("" at the end of the body).
func (s *sseStream) next() string {
	for s.sc.Scan() {
		if data, ok := strings.CutPrefix(s.sc.Text(), "data: "); ok {
			return data
		}
	}
	return ""
}

// rest reads to the end and returns the finish reasons seen and whether
// [DONE] came.
func (s *sseStream) rest() (finishes []string, done bool) {
	for data := s.next(); data != ""; data = s.next() {
		if data == "[DONE]" {
			return finishes, true
		}
		var c struct {
			Choices []struct {
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		_ = json.Unmarshal([]byte(data), &c)
		for _, ch := range c.Choices {
			if ch.FinishReason != nil {
				finishes = append(finishes, *ch.FinishReason)
			}
		}
	}
	return finishes, false
}

func post(t *testing.T, url string) reply {
	t.Helper()
	return do(t, http.MethodPost, url, nil, nil)
}

func isPaused(t *testing.T, base string) bool {
	t.Helper()
	rep := do(t, http.MethodGet, base+"/is_paused", nil, nil)
	var out struct {
		IsPaused *bool `json:"is_paused"`
	}
	if rep.status != http.StatusOK || json.Unmarshal(rep.body, &out) != nil || out.IsPaused == nil {
		t.Fatalf("GET /is_paused: %d %s", rep.status, rep.body)
	}
	return *out.IsPaused
}

// eventually waits for cond, failing the test after testTimeout.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestPauseEndpoints(t *testing.T) {
	_, base := start(t, mockllm.Options{EngineID: "e1"})
	if isPaused(t, base) {
		t.Fatal("a new engine is paused")
	}
	rep := post(t, base+"/pause?mode=sleep")
	if rep.status != http.StatusUnprocessableEntity || !strings.Contains(string(rep.body), `"mode"`) {
		t.Errorf("pause with an unknown mode: %d %s, want 422 naming mode", rep.status, rep.body)
	}
	if isPaused(t, base) {
		t.Error("a refused pause paused the engine")
	}
	for _, mode := range []string{"keep", "wait", "abort", ""} {
		rep := post(t, base+"/pause?mode="+mode)
		if rep.status != http.StatusOK || string(rep.body) != `{"status":"paused"}` {
			t.Errorf("pause %q: %d %s", mode, rep.status, rep.body)
		}
		if rep.header.Get(mockllm.EngineHeader) != "e1" {
			t.Errorf("pause answer names engine %q, want e1", rep.header.Get(mockllm.EngineHeader))
		}
		if !isPaused(t, base) {
			t.Errorf("after pause %q the engine is not paused", mode)
		}
		for range 2 { // a second resume is harmless, as on vLLM
			if rep := post(t, base+"/resume"); rep.status != http.StatusOK || string(rep.body) != `{"status":"resumed"}` {
				t.Errorf("resume: %d %s", rep.status, rep.body)
			}
		}
		if isPaused(t, base) {
			t.Errorf("after resume the engine is still paused")
		}
	}
	if rep := do(t, http.MethodGet, base+"/pause", nil, nil); rep.status != http.StatusMethodNotAllowed {
		t.Errorf("GET /pause: %d, want 405", rep.status)
	}

	_, plain := start(t, mockllm.Options{PauseAPI: mockllm.PauseAPINone})
	for _, p := range []string{"/pause", "/resume"} {
		if rep := post(t, plain+p); rep.status != http.StatusNotFound {
			t.Errorf("POST %s without pause endpoints: %d, want 404", p, rep.status)
		}
	}
	if rep := do(t, http.MethodGet, plain+"/is_paused", nil, nil); rep.status != http.StatusNotFound {
		t.Errorf("GET /is_paused without pause endpoints: %d, want 404", rep.status)
	}
}

// TestPauseKeep: a stream in flight freezes and a new request waits, both
// finishing normally after the resume.
func TestPauseKeep(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), testTimeout)
	defer cancel()
	_, base := start(t, mockllm.Options{ChunkDelay: 2 * time.Millisecond})
	s := openStream(t, ctx, base)
	if s.next() == "" {
		t.Fatal("no first chunk")
	}
	if rep := post(t, base+"/pause?mode=keep"); rep.status != http.StatusOK {
		t.Fatalf("pause keep: %d %s", rep.status, rep.body)
	}
	var resumed atomic.Bool
	type result struct {
		finishes []string
		done     bool
		early    bool
	}
	streamed := make(chan result, 1)
	go func() {
		f, d := s.rest()
		streamed <- result{f, d, !resumed.Load()}
	}()
	answered := make(chan reply, 1)
	var answeredEarly atomic.Bool
	go func() {
		rep := do(t, http.MethodPost, base+"/v1/chat/completions", map[string]any{"messages": sixTimesSeven}, nil)
		answeredEarly.Store(!resumed.Load())
		answered <- rep
	}()
	// Long enough for an unfrozen stream (8 chunks, 2 ms apart) to end.
	time.Sleep(50 * time.Millisecond)
	resumed.Store(true)
	if rep := post(t, base+"/resume"); rep.status != http.StatusOK {
		t.Fatalf("resume: %d", rep.status)
	}
	r := <-streamed
	if r.early || !r.done || len(r.finishes) != 1 || r.finishes[0] != "stop" {
		t.Errorf("stream under keep: finishes %v, [DONE] %v, ended before the resume %v; want one stop after the resume", r.finishes, r.done, r.early)
	}
	rep := <-answered
	if answeredEarly.Load() || rep.status != http.StatusOK || !strings.Contains(string(rep.body), `"finish_reason":"stop"`) {
		t.Errorf("request sent while paused: %d %s (before the resume: %v)", rep.status, rep.body, answeredEarly.Load())
	}
}

// TestPauseAbort: requests in flight end at once with finish_reason
// "abort" (a stream with its abort chunk and [DONE]); requests sent during
// the pause wait and are answered whole after the resume.
func TestPauseAbort(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), testTimeout)
	defer cancel()
	srv, base := start(t, mockllm.Options{ChunkDelay: time.Hour})
	s := openStream(t, ctx, base)
	if s.next() == "" {
		t.Fatal("no first chunk")
	}
	slowSrv, slowBase := start(t, mockllm.Options{Latency: time.Hour})
	slow := make(chan reply, 1)
	go func() {
		slow <- do(t, http.MethodPost, slowBase+"/v1/chat/completions", map[string]any{"messages": sixTimesSeven}, nil)
	}()
	if rep := post(t, base+"/pause?mode=abort"); rep.status != http.StatusOK {
		t.Fatalf("pause abort: %d", rep.status)
	}
	finishes, done := s.rest()
	if !done || len(finishes) != 1 || finishes[0] != "abort" {
		t.Errorf("aborted stream: finishes %v, [DONE] %v; want [abort] and [DONE]", finishes, done)
	}
	// The non-streamed request is aborted before its answer was generated.
	eventually(t, "the slow request in flight", func() bool { return slowSrv.InFlight() == 1 })
	if rep := post(t, slowBase+"/pause"); rep.status != http.StatusOK { // abort is the default
		t.Fatalf("pause: %d", rep.status)
	}
	rep := <-slow
	var c struct {
		Choices []struct {
			Message struct {
				Content   *string `json:"content"`
				ToolCalls []any   `json:"tool_calls"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens *int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if rep.status != http.StatusOK || json.Unmarshal(rep.body, &c) != nil || len(c.Choices) != 1 ||
		c.Choices[0].FinishReason != "abort" || c.Usage.CompletionTokens == nil || *c.Usage.CompletionTokens != 0 {
		t.Errorf("aborted request: %d %s, want 200, finish_reason abort, 0 completion tokens", rep.status, rep.body)
	}

	// Paused: a new request waits for the resume, and is not aborted by it.
	var resumed atomic.Bool
	later := make(chan string, 1)
	go func() {
		s := openStream(t, ctx, base)
		f, _ := s.rest()
		if !resumed.Load() {
			later <- "answered before the resume"
			return
		}
		later <- strings.Join(f, ",")
	}()
	eventually(t, "the engine to count no request in flight", func() bool { return srv.InFlight() == 0 })
	time.Sleep(20 * time.Millisecond) // a chance to answer too early
	resumed.Store(true)
	post(t, base+"/resume")
	// ChunkDelay is an hour: the stream would not end; its first chunk
	// after the resume shows it was admitted. End it by an abort.
	eventually(t, "the held request admitted", func() bool { return srv.InFlight() == 1 })
	post(t, base+"/pause?mode=abort")
	if got := <-later; got != "abort" {
		t.Errorf("request held by the pause: %s, want it admitted after the resume", got)
	}
}

// TestPauseWait: the pause's answer comes once the stream in flight has
// finished whole; a pause whose client leaves leaves the engine paused.
func TestPauseWait(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), testTimeout)
	defer cancel()
	srv, base := start(t, mockllm.Options{ChunkDelay: 2 * time.Millisecond})
	s := openStream(t, ctx, base)
	if s.next() == "" {
		t.Fatal("no first chunk")
	}
	if rep := post(t, base+"/pause?mode=wait"); rep.status != http.StatusOK {
		t.Fatalf("pause wait: %d", rep.status)
	}
	if n := srv.InFlight(); n != 0 {
		t.Errorf("pause wait answered with %d requests in flight", n)
	}
	if finishes, done := s.rest(); !done || len(finishes) != 1 || finishes[0] != "stop" {
		t.Errorf("stream under wait: finishes %v, [DONE] %v; want [stop]", finishes, done)
	}
	post(t, base+"/resume")

	_, hangBase := start(t, mockllm.Options{FailMode: mockllm.FailHang, FailFirst: 1})
	go func() {
		hctx, hcancel := context.WithTimeout(ctx, time.Hour)
		defer hcancel()
		b, _ := json.Marshal(map[string]any{"messages": sixTimesSeven})
		req, _ := http.NewRequestWithContext(hctx, http.MethodPost, hangBase+"/v1/chat/completions", bytes.NewReader(b))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close()
		}
	}()
	pctx, pcancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer pcancel()
	req, _ := http.NewRequestWithContext(pctx, http.MethodPost, hangBase+"/pause?mode=wait", nil)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		_ = resp.Body.Close()
		// Either the hung request was not yet admitted (then the pause
		// answers at once) or the client gave up; the engine is paused
		// in both cases.
	} else if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("pause wait on a hung engine: %v", err)
	}
	if !isPaused(t, hangBase) {
		t.Error("a wait pause whose client left did not pause the engine")
	}
}

// TestFailFraction: about the fraction asked fails, the same requests for
// the same seed.
func TestFailFraction(t *testing.T) {
	run := func(seed uint64) []int {
		_, base := start(t, mockllm.Options{FailMode: mockllm.Fail503, FailFraction: 0.25, FailSeed: seed})
		var failed []int
		for i := range 200 {
			rep := do(t, http.MethodPost, base+"/v1/chat/completions", map[string]any{"messages": sixTimesSeven}, nil)
			switch rep.status {
			case http.StatusOK:
			case http.StatusServiceUnavailable:
				failed = append(failed, i)
			default:
				t.Fatalf("request %d: %d %s", i, rep.status, rep.body)
			}
		}
		return failed
	}
	a, b := run(7), run(7)
	if len(a) < 25 || len(a) > 75 {
		t.Errorf("%d of 200 requests failed with FailFraction 0.25", len(a))
	}
	if !slicesEqual(a, b) {
		t.Errorf("the same seed failed different requests: %v and %v", a, b)
	}
	if c := run(8); slicesEqual(a, c) {
		t.Errorf("seeds 7 and 8 failed the same requests %v", a)
	}
	for _, o := range []mockllm.Options{{FailMode: "500", FailFraction: 1.5}, {FailMode: "500", FailFraction: -0.1}, {FailFraction: 0.5}, {DieAfter: -1}} {
		if _, err := mockllm.New(o); err == nil {
			t.Errorf("New(%+v) accepted", o)
		}
	}
}

func slicesEqual(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestDieAfter: the engine answers until its DieAfter-th request, whose
// connection (and every later one's) is cut without an answer; Dead tells
// its server to close.
func TestDieAfter(t *testing.T) {
	srv, base := start(t, mockllm.Options{DieAfter: 3, EngineID: "e7"})
	for i := range 2 {
		rep := do(t, http.MethodPost, base+"/v1/chat/completions", map[string]any{"messages": sixTimesSeven}, nil)
		if rep.status != http.StatusOK || rep.header.Get(mockllm.EngineHeader) != "e7" || !strings.Contains(string(rep.body), `"system_fingerprint":"fp_osmo_mock_e7"`) {
			t.Fatalf("request %d before dying: %d %v %s", i, rep.status, rep.header, rep.body)
		}
	}
	select {
	case <-srv.Dead():
		t.Fatal("dead before its DieAfter-th request")
	default:
	}
	for i := range 2 {
		b, _ := json.Marshal(map[string]any{"messages": sixTimesSeven})
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(b))
		if err == nil {
			_ = resp.Body.Close()
			t.Fatalf("request %d after dying answered %d", i+3, resp.StatusCode)
		}
	}
	select {
	case <-srv.Dead():
	default:
		t.Fatal("Dead not closed")
	}
}

// TestLogsSession: each chat request is logged with the plane's session,
// the engine and the sample, so a rig can check affinity from the logs.
func TestLogsSession(t *testing.T) {
	var buf logtest.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	_, base := start(t, mockllm.Options{EngineID: "e3", Logger: log})
	rep := do(t, http.MethodPost, base+"/v1/chat/completions", map[string]any{"messages": sixTimesSeven},
		map[string]string{mockllm.SessionHeader: "r1/s2", "X-Sample-Id": "s2"})
	if rep.status != http.StatusOK {
		t.Fatalf("chat: %d %s", rep.status, rep.body)
	}
	recs, err := buf.Records()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r["msg"] == "mockllm: chat completion" {
			if r["session_id"] != "r1/s2" || r["engine"] != "e3" || r["sample_id"] != "s2" {
				t.Errorf("chat record %v, want session_id r1/s2, engine e3, sample_id s2", r)
			}
			return
		}
	}
	t.Errorf("no chat completion record in %v", recs)
}

// TestSGLangPauseEndpoints: with PauseAPI sglang the engine serves
// SGLang's pause and continue instead of vLLM's, and refuses a mode
// SGLang does not have.
func TestSGLangPauseEndpoints(t *testing.T) {
	srv, base := start(t, mockllm.Options{PauseAPI: mockllm.PauseAPISGLang})
	for _, mode := range []string{"abort", "retract", "in_place"} {
		rep := do(t, http.MethodPost, base+"/pause_generation", []byte(`{"mode":"`+mode+`"}`), nil)
		if rep.status != http.StatusOK || !srv.Paused() {
			t.Errorf("pause_generation %q: %d %s, paused %v", mode, rep.status, rep.body, srv.Paused())
		}
		if rep := do(t, http.MethodPost, base+"/continue_generation", []byte(`{}`), nil); rep.status != http.StatusOK || srv.Paused() {
			t.Errorf("continue_generation: %d %s, paused %v", rep.status, rep.body, srv.Paused())
		}
	}
	if rep := do(t, http.MethodPost, base+"/pause_generation", []byte(`{"mode":"keep"}`), nil); rep.status != http.StatusBadRequest || srv.Paused() {
		t.Errorf("pause_generation keep: %d %s, paused %v; want 400 and not paused", rep.status, rep.body, srv.Paused())
	}
	for _, p := range []string{"/pause", "/resume", "/is_paused"} {
		if rep := post(t, base+p); rep.status != http.StatusNotFound {
			t.Errorf("POST %s on an SGLang engine: %d, want 404", p, rep.status)
		}
	}
	if _, err := mockllm.New(mockllm.Options{PauseAPI: "trt"}); err == nil || !strings.Contains(err.Error(), "PauseAPI") {
		t.Errorf("unknown PauseAPI: %v, want an error naming it", err)
	}
}
