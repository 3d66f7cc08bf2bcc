package gateway_test

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

func testRows() []*rolloutv1.Row {
	return []*rolloutv1.Row{
		{RolloutId: "a", SampleId: "s", Row: 0, TokenIds: []int32{1, 2}, LossMask: []int32{0, 1}, Logprobs: []float64{0, -0.5}, Merge: "exact", Calls: []int32{0}, Cursor: "7-0", Reward: proto.Float64(1)},
		{RolloutId: "a", SampleId: "s", Row: 1, TokenIds: []int32{3}, LossMask: []int32{1}, Logprobs: []float64{-1}, Merge: "forked", Calls: []int32{1},
			Drift: []*rolloutv1.Drift{{Call: 1, Position: 1, Class: "whitespace"}}, Cursor: "7-1"},
	}
}

// TestStreamRowsREST: each line is a row itself, under the proto names,
// and the query reaches the service.
func TestStreamRowsREST(t *testing.T) {
	fake := &fakeRollout{rows: testRows()}
	h := newHarness(t, fake)
	resp := h.do(t, http.MethodGet, "/v1/rows:stream?after=6-3&merge=realign", "", nil)
	if ct := resp.header.Get("Content-Type"); ct != "application/x-ndjson" {
		t.Errorf("Content-Type = %q", ct)
	}
	lines := readLines(t, resp)
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2: %v", len(lines), lines)
	}
	for i, want := range []string{"7-0", "7-1"} {
		if lines[i]["cursor"] != want || lines[i]["rollout_id"] != "a" || lines[i]["result"] != nil {
			t.Errorf("line %d = %v, want the row with cursor %s", i, lines[i], want)
		}
	}
	if ids, _ := lines[0]["token_ids"].([]any); len(ids) != 2 || lines[0]["loss_mask"] == nil || lines[0]["reward"] != 1.0 {
		t.Errorf("line 0 = %v", lines[0])
	}
	if d, _ := lines[1]["drift"].([]any); len(d) != 1 || d[0].(map[string]any)["class"] != "whitespace" {
		t.Errorf("line 1 drift = %v", lines[1]["drift"])
	}
	if req := fake.rowsRequest(); req.GetAfter() != "6-3" || req.GetMerge() != "realign" {
		t.Errorf("request = %v", req)
	}
}

// TestStreamRowsRESTHeadersFirst: a stream the service accepted answers
// its headers before any row exists.
func TestStreamRowsRESTHeadersFirst(t *testing.T) {
	for _, traced := range []bool{false, true} {
		t.Run(fmt.Sprintf("traced=%v", traced), func(t *testing.T) { testRowsHeadersFirst(t, traced) })
	}
}

func testRowsHeadersFirst(t *testing.T, traced bool) {
	fake := &fakeRollout{rows: testRows(), rowsHold: make(chan struct{})}
	var opts []harnessOption
	if traced {
		tp := sdktrace.NewTracerProvider()
		t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		opts = append(opts, withTracing(tp))
	}
	h := newHarness(t, fake, opts...)
	req, err := http.NewRequestWithContext(testContext(t), http.MethodGet, h.restURL+"/v1/rows:stream?after=now", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		t.Fatalf("no headers while the stream waits for rows: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/x-ndjson" {
		t.Fatalf("status %d, Content-Type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	close(fake.rowsHold)
	sc := bufio.NewScanner(resp.Body)
	n := 0
	for sc.Scan() {
		if !strings.Contains(sc.Text(), `"cursor":"7-`) {
			t.Errorf("line %q", sc.Text())
		}
		n++
	}
	if n != 2 {
		t.Errorf("got %d lines, want 2", n)
	}
}

func TestStreamRowsRESTFailingAtOnce(t *testing.T) {
	h := newHarness(t, &fakeRollout{rowsAtOnce: status.Error(codes.InvalidArgument, "after: garbage")})
	resp := h.do(t, http.MethodGet, "/v1/rows:stream?after=garbage", "", nil)
	if resp.status != http.StatusUnprocessableEntity {
		t.Fatalf("status = %d, want 422; body %s", resp.status, resp.body)
	}
	if got := resp.detail(t); got != "after: garbage" {
		t.Errorf("detail = %q", got)
	}
}

// TestStreamRowsRESTErrorBeforeRows: a stream failing after it was
// accepted, before any row, ends with an error line under the 200 sent.
func TestStreamRowsRESTErrorBeforeRows(t *testing.T) {
	h := newHarness(t, &fakeRollout{rowsErr: status.Error(codes.Unavailable, "state lost")})
	lines := readLines(t, h.do(t, http.MethodGet, "/v1/rows:stream", "", nil))
	if len(lines) != 1 {
		t.Fatalf("lines = %v", lines)
	}
	if e, ok := lines[0]["error"].(map[string]any); !ok || e["message"] != "state lost" || e["code"] != float64(codes.Unavailable) {
		t.Errorf("line = %v, want an error for Unavailable: state lost", lines[0])
	}
}

func TestStreamRowsRESTErrorMidStream(t *testing.T) {
	h := newHarness(t, &fakeRollout{rows: testRows()[:1], rowsErr: status.Error(codes.Internal, "store lost")})
	lines := readLines(t, h.do(t, http.MethodGet, "/v1/rows:stream", "", nil))
	if len(lines) != 2 || lines[0]["cursor"] != "7-0" {
		t.Fatalf("lines = %v", lines)
	}
	if e, ok := lines[1]["error"].(map[string]any); !ok || e["message"] != "store lost" {
		t.Errorf("last line = %v, want an error", lines[1])
	}
}

func TestStreamRowsConnect(t *testing.T) {
	fake := &fakeRollout{rows: testRows()}
	h := newHarness(t, fake)
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			stream, err := p.rollout(h).StreamRows(testContext(t), &rolloutv1.StreamRowsRequest{After: "6-3"})
			if err != nil {
				t.Fatalf("StreamRows: %v", err)
			}
			defer stream.Close()
			var got []*rolloutv1.Row
			for stream.Receive() {
				got = append(got, stream.Msg())
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("stream: %v", err)
			}
			want := testRows()
			if len(got) != len(want) || !proto.Equal(got[0], want[0]) || !proto.Equal(got[1], want[1]) {
				t.Errorf("rows = %v", got)
			}
		})
	}
	bad := newHarness(t, &fakeRollout{rowsAtOnce: status.Error(codes.InvalidArgument, "after: garbage")})
	for _, p := range protocols() {
		stream, err := p.rollout(bad).StreamRows(testContext(t), &rolloutv1.StreamRowsRequest{After: "x"})
		if err != nil {
			t.Fatalf("%s: %v", p.name, err)
		}
		for stream.Receive() {
		}
		if connect.CodeOf(stream.Err()) != connect.CodeInvalidArgument {
			t.Errorf("%s: %v, want invalid_argument", p.name, stream.Err())
		}
		stream.Close()
	}
}
