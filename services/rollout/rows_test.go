package rollout_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/gen/osmo/rollout/v1/rolloutv1connect"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/rows"
	"github.com/osmo-rl/osmo/internal/sample"
	"github.com/osmo-rl/osmo/services/rollout"
)

// tokenInit is a G1 init whose calls ask the policy for token ids and
// logprobs, as the proxy does when rows are on.
func (h *harness) tokenInit(t *testing.T, id string, a, b int) *rolloutv1.InitRolloutRequest {
	t.Helper()
	req := h.initReq(t, id, a, b, nil)
	req.CompletionParams = mustStruct(t, map[string]any{"return_token_ids": true, "logprobs": true})
	return req
}

// runTokenRollout starts a token-bearing rollout and waits for its record.
func (h *harness) runTokenRollout(t *testing.T, id string, a, b int) *rolloutv1.Rollout {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := h.client.InitRollout(ctx, h.tokenInit(t, id, a, b)); err != nil {
		t.Fatal(err)
	}
	return h.waitDone(t, id)
}

// wantRows builds, from a rollout's record as GetRollout answers it, the
// rows the API should answer.
func wantRows(t *testing.T, r *rolloutv1.Rollout, mode string) []*rolloutv1.Row {
	t.Helper()
	var out []*rolloutv1.Row
	for _, s := range r.GetSamples() {
		calls := make([]*osmo.LLMCall, len(s.GetLlmCalls()))
		for i, c := range s.GetLlmCalls() {
			calls[i] = &osmo.LLMCall{}
			if err := sample.FromProto(c, calls[i]); err != nil {
				t.Fatal(err)
			}
		}
		res := rows.Build(rows.Sample{RolloutID: r.GetRolloutId(), SampleID: s.GetId(), Reward: s.Reward, Calls: calls}, rows.Options{Merge: mode})
		for _, row := range res.Rows {
			p := &rolloutv1.Row{}
			if err := sample.ToProto(row, p); err != nil {
				t.Fatal(err)
			}
			out = append(out, p)
		}
	}
	return out
}

// checkRow checks what holds of every row: the three arrays align, the
// mask is 0 or 1, and the row covers calls.
func checkRow(t *testing.T, row *rolloutv1.Row) {
	t.Helper()
	n := len(row.GetTokenIds())
	if n == 0 || len(row.GetLossMask()) != n || len(row.GetLogprobs()) != n || len(row.GetCalls()) == 0 {
		t.Errorf("row %s/%d: %d tokens, %d mask, %d logprobs, calls %v", row.GetSampleId(), row.GetRow(), n, len(row.GetLossMask()), len(row.GetLogprobs()), row.GetCalls())
	}
	for i, m := range row.GetLossMask() {
		if m != 0 && m != 1 || m == 0 && row.GetLogprobs()[i] != 0 {
			t.Errorf("row %s/%d token %d: mask %d logprob %v", row.GetSampleId(), row.GetRow(), i, m, row.GetLogprobs()[i])
			return
		}
	}
}

func TestGetRolloutRows(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	r := h.runTokenRollout(t, "rows-1", 6, 7)
	if len(r.GetSamples()) != 1 || len(r.GetSamples()[0].GetLlmCalls()) != 2 {
		t.Fatalf("rollout = %v", r)
	}
	for _, c := range r.GetSamples()[0].GetLlmCalls() {
		if len(c.GetPromptTokenIds()) == 0 || len(c.GetCompletionTokenIds()) == 0 {
			t.Fatalf("a call lacks token ids: %v", c)
		}
	}
	ctx := t.Context()
	for _, merge := range []string{"", "exact", "realign"} {
		got, err := h.client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-1", Merge: merge})
		if err != nil {
			t.Fatalf("merge %q: %v", merge, err)
		}
		mode := merge
		if mode == "" {
			mode = rows.MergeExact
		}
		want := wantRows(t, r, mode)
		if len(got.GetRows()) == 0 || len(got.GetRows()) != len(want) {
			t.Fatalf("merge %q: %d rows, want %d (and some)", merge, len(got.GetRows()), len(want))
		}
		for i, row := range got.GetRows() {
			checkRow(t, row)
			if !proto.Equal(row, want[i]) {
				t.Errorf("merge %q row %d = %v, want %v", merge, i, row, want[i])
			}
			if row.GetRolloutId() != "rows-1" || row.GetRow() != int32(i) || row.Reward != nil {
				t.Errorf("merge %q row %d: ids %s/%d, reward %v", merge, i, row.GetRolloutId(), row.GetRow(), row.Reward)
			}
		}
		if s := got.GetSamples(); len(s) != 1 || s[0].GetSampleId() != r.GetSamples()[0].GetId() || s[0].GetRows() != int32(len(want)) {
			t.Errorf("merge %q: samples = %v", merge, s)
		}
	}
	// The first row starts with the first call's prompt, masked out.
	got, err := h.client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-1"})
	if err != nil {
		t.Fatal(err)
	}
	first, prompt := got.GetRows()[0], r.GetSamples()[0].GetLlmCalls()[0].GetPromptTokenIds()
	if first.GetMerge() != rows.MergeExact || len(first.GetTokenIds()) <= len(prompt) || !equalIDs(first.GetTokenIds()[:len(prompt)], prompt) || first.GetLossMask()[0] != 0 {
		t.Errorf("first row %v does not start with the first prompt %v", first, prompt)
	}
}

func equalIDs(a, b []int32) bool {
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

// TestGetRolloutRowsReward: a graded sample's reward is on each of its rows.
func TestGetRolloutRowsReward(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.Grader = &fakeGrader{fn: rewardByCalculator}
		c.GraderName = "calculator"
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := h.tokenInit(t, "rows-graded", 6, 7)
	req.Metadata = mustStruct(t, map[string]any{"ground_truth": "42"})
	if _, err := h.client.InitRollout(ctx, req); err != nil {
		t.Fatal(err)
	}
	h.waitDone(t, "rows-graded")
	got, err := h.client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-graded"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.GetRows()) == 0 {
		t.Fatal("no rows")
	}
	for _, row := range got.GetRows() {
		if row.Reward == nil || row.GetReward() != 1 {
			t.Errorf("row %d reward = %v, want 1", row.GetRow(), row.Reward)
		}
	}
}

// TestGetRolloutRowsWithoutTokens: calls whose agent said no to token ids
// give no rows, and the sample says which calls and why.
func TestGetRolloutRowsWithoutTokens(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := h.initReq(t, "rows-none", 2, 3, nil)
	req.CompletionParams = mustStruct(t, map[string]any{"return_token_ids": false})
	if _, err := h.client.InitRollout(ctx, req); err != nil {
		t.Fatal(err)
	}
	h.waitDone(t, "rows-none")
	got, err := h.client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-none"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.GetRows()) != 0 || len(got.GetSamples()) != 1 {
		t.Fatalf("rows = %v", got)
	}
	if s := got.GetSamples()[0]; s.GetRows() != 0 || len(s.GetProblems()) != 2 || s.GetProblems()[0].GetReason() == "" {
		t.Errorf("sample = %v, want no rows and both calls as problems", s)
	}
}

func TestGetRolloutRowsErrors(t *testing.T) {
	h := newHarness(t, harnessOpts{mock: mockllm.Options{Latency: 3 * time.Second, Logger: quietLogger()}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := h.client.InitRollout(ctx, h.tokenInit(t, "rows-running", 1, 1)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req   *rolloutv1.GetRolloutRowsRequest
		code  codes.Code
		field string
	}{
		{&rolloutv1.GetRolloutRowsRequest{}, codes.InvalidArgument, "rollout_id"},
		{&rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-running", Merge: "fuzzy"}, codes.InvalidArgument, "merge"},
		{&rolloutv1.GetRolloutRowsRequest{RolloutId: "nobody"}, codes.NotFound, ""},
		{&rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-running"}, codes.FailedPrecondition, ""},
	} {
		_, err := h.client.GetRolloutRows(ctx, tc.req)
		if status.Code(err) != tc.code {
			t.Errorf("%v: %v, want %s", tc.req, err, tc.code)
			continue
		}
		if tc.field != "" && badField(err) != tc.field {
			t.Errorf("%v: %v names field %q, want %q", tc.req, err, badField(err), tc.field)
		}
	}
}

// badField is the field an InvalidArgument error's BadRequest names.
func badField(err error) string {
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) > 0 {
			return br.GetFieldViolations()[0].GetField()
		}
	}
	return ""
}

// rowStream reads a StreamRows stream.
type rowStream struct {
	recv   func() (*rolloutv1.Row, error)
	cancel context.CancelFunc
}

func openRows(t *testing.T, client rolloutv1.RolloutServiceClient, after string) *rowStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	stream, err := client.StreamRows(ctx, &rolloutv1.StreamRowsRequest{After: after})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(cancel)
	// The headers come once the service reads the state: "now" is then.
	if _, err := stream.Header(); err != nil {
		t.Fatal(err)
	}
	return &rowStream{recv: stream.Recv, cancel: cancel}
}

// next reads n rows.
func (s *rowStream) next(t *testing.T, n int) []*rolloutv1.Row {
	t.Helper()
	out := make([]*rolloutv1.Row, 0, n)
	for range n {
		row, err := s.recv()
		if err != nil {
			t.Fatalf("after %d of %d rows: %v", len(out), n, err)
		}
		checkRow(t, row)
		out = append(out, row)
	}
	return out
}

// rowKey names a row once: its rollout, sample and index.
func rowKey(r *rolloutv1.Row) string {
	return fmt.Sprintf("%s/%s/%d", r.GetRolloutId(), r.GetSampleId(), r.GetRow())
}

func keys(rs []*rolloutv1.Row) string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = rowKey(r)
	}
	return strings.Join(out, " ")
}

// rowsOf is every row of the rollouts, in order, as GetRolloutRows has them.
func rowsOf(t *testing.T, client rolloutv1.RolloutServiceClient, ids ...string) []*rolloutv1.Row {
	t.Helper()
	var out []*rolloutv1.Row
	for _, id := range ids {
		got, err := client.GetRolloutRows(t.Context(), &rolloutv1.GetRolloutRowsRequest{RolloutId: id})
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, got.GetRows()...)
	}
	return out
}

func TestStreamRowsResumes(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	for i, id := range []string{"s-1", "s-2"} {
		h.runTokenRollout(t, id, 2+i, 3)
	}
	all := rowsOf(t, h.client, "s-1", "s-2")
	if len(all) < 2 {
		t.Fatalf("only %d rows", len(all))
	}
	// From the start: every held row, in order, each with a cursor.
	s := openRows(t, h.client, "")
	got := s.next(t, len(all))
	if keys(got) != keys(all) {
		t.Fatalf("stream = %s, want %s", keys(got), keys(all))
	}
	for i, row := range got {
		row.Cursor = ""
		if !proto.Equal(row, all[i]) {
			t.Errorf("streamed row %d differs from GetRolloutRows'", i)
		}
	}
	s.cancel()

	// After each cursor: exactly the rows after it.
	cursors := make([]string, len(got))
	s = openRows(t, h.client, "")
	for i, row := range s.next(t, len(all)) {
		cursors[i] = row.GetCursor()
	}
	s.cancel()
	for i, c := range cursors[:len(cursors)-1] {
		r := openRows(t, h.client, c)
		if rest := r.next(t, len(all)-i-1); keys(rest) != keys(all[i+1:]) {
			t.Errorf("after %s: %s, want %s", c, keys(rest), keys(all[i+1:]))
		}
		r.cancel()
	}

	// After the last cursor and with "now": only rows of later rollouts.
	last := openRows(t, h.client, cursors[len(cursors)-1])
	now := openRows(t, h.client, "now")
	h.runTokenRollout(t, "s-3", 5, 5)
	want := keys(rowsOf(t, h.client, "s-3"))
	n := len(rowsOf(t, h.client, "s-3"))
	for name, s := range map[string]*rowStream{"last cursor": last, "now": now} {
		if got := keys(s.next(t, n)); got != want {
			t.Errorf("%s: %s, want %s", name, got, want)
		}
	}
}

// TestStreamRowsOldCursor: a cursor older than the records held gives the
// rows held after it.
func TestStreamRowsOldCursor(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.RecordTTL = time.Second }})
	h.runTokenRollout(t, "old-1", 2, 3)
	s := openRows(t, h.client, "")
	old := s.next(t, 1)[0].GetCursor()
	s.cancel()
	// The first record expires.
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := h.client.GetRolloutRows(t.Context(), &rolloutv1.GetRolloutRowsRequest{RolloutId: "old-1"})
		if status.Code(err) == codes.NotFound {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the record of old-1 was still held after 10s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.runTokenRollout(t, "old-2", 4, 3)
	want := rowsOf(t, h.client, "old-2")
	s = openRows(t, h.client, old)
	if got := s.next(t, len(want)); keys(got) != keys(want) {
		t.Errorf("after an expired cursor: %s, want %s", keys(got), keys(want))
	}
}

func TestStreamRowsBadRequests(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	h.runTokenRollout(t, "bad-1", 2, 3)
	s := openRows(t, h.client, "")
	cursor := s.next(t, 1)[0].GetCursor()
	s.cancel()
	state := cursor[strings.LastIndex(cursor, "-")+1:]
	for _, tc := range []struct{ after, merge, field string }{
		{"yesterday", "", "after"},
		{"12", "", "after"},
		{"12-0", "", "after"},
		{"0-1-" + state, "", "after"},
		{"1--1-" + state, "", "after"},
		{"1-x-" + state, "", "after"},
		{"1-0-", "", "after"},
		{"1-0-" + state + "-2", "", "after"},
		{"99999-0-" + state, "", "after"}, // past the last record
		{"", "loose", "merge"},
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		stream, err := h.client.StreamRows(ctx, &rolloutv1.StreamRowsRequest{After: tc.after, Merge: tc.merge})
		if err == nil {
			_, err = stream.Recv()
		}
		cancel()
		if status.Code(err) != codes.InvalidArgument || badField(err) != tc.field {
			t.Errorf("after %q merge %q: %v, want InvalidArgument naming %s", tc.after, tc.merge, err, tc.field)
		}
		if errors.Is(err, io.EOF) {
			t.Errorf("after %q: the stream ended without an error", tc.after)
		}
	}
}

// TestStreamRowsCursorOfAnotherState: a cursor from a state that is gone
// (another one, or this one wiped and made anew, which numbers its records
// from 1 again) gives every row held, rather than skipping those whose
// sequence is below it.
func TestStreamRowsCursorOfAnotherState(t *testing.T) {
	gone := newHarness(t, harnessOpts{})
	for i, id := range []string{"gone-1", "gone-2", "gone-3"} {
		gone.runTokenRollout(t, id, 2+i, 3)
	}
	all := rowsOf(t, gone.client, "gone-1", "gone-2", "gone-3")
	s := openRows(t, gone.client, "")
	last := s.next(t, len(all))[len(all)-1].GetCursor()
	s.cancel()

	h := newHarness(t, harnessOpts{})
	for i, id := range []string{"new-1", "new-2", "new-3", "new-4"} {
		h.runTokenRollout(t, id, 5+i, 2)
	}
	want := rowsOf(t, h.client, "new-1", "new-2", "new-3", "new-4")
	s = openRows(t, h.client, last)
	if got := s.next(t, len(want)); keys(got) != keys(want) {
		t.Errorf("after %s of another state: %s, want every row held: %s", last, keys(got), keys(want))
	}
}

// TestRowsOverRESTAndConnect: the gateway answers the rows of a rollout
// with token-bearing calls as gRPC does, REST under the proto names.
func TestRowsOverRESTAndConnect(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	h.runTokenRollout(t, "web-1", 6, 7)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	want, err := h.client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: "web-1"})
	if err != nil {
		t.Fatal(err)
	}

	resp, body := httpGet(t, ctx, h.rest+"/v1/rollouts/web-1/rows")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("REST: %d %s", resp.StatusCode, body)
	}
	var raw struct {
		Rows []map[string]any `json:"rows"`
	}
	if err := json.Unmarshal(body, &raw); err != nil || len(raw.Rows) != len(want.GetRows()) {
		t.Fatalf("REST body %s: %v", body, err)
	}
	for _, key := range []string{"rollout_id", "sample_id", "row", "token_ids", "loss_mask", "logprobs", "merge", "calls", "drift", "problems"} {
		if _, ok := raw.Rows[0][key]; !ok {
			t.Errorf("REST row lacks %q: %v", key, raw.Rows[0])
		}
	}
	got := &rolloutv1.RolloutRows{}
	if err := protojson.Unmarshal(body, got); err != nil || !proto.Equal(got, want) {
		t.Errorf("REST rows differ from gRPC's: %v", err)
	}

	client := rolloutv1connect.NewRolloutServiceClient(http.DefaultClient, h.rest)
	cresp, err := client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: "web-1"})
	if err != nil || !proto.Equal(cresp, want) {
		t.Errorf("Connect rows differ from gRPC's: %v", err)
	}
	stream, err := client.StreamRows(ctx, &rolloutv1.StreamRowsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range want.GetRows() {
		if !stream.Receive() {
			t.Fatalf("Connect stream ended after %d rows: %v", i, stream.Err())
		}
		row := stream.Msg()
		if row.GetCursor() == "" {
			t.Errorf("Connect row %d has no cursor", i)
		}
		row.Cursor = ""
		if !proto.Equal(row, want.GetRows()[i]) {
			t.Errorf("Connect streamed row %d differs", i)
		}
	}
	_ = stream.Close()

	// REST stream: one row per line, then resumed after the first row's cursor.
	lines := restRows(t, ctx, h.rest+"/v1/rows:stream", len(want.GetRows()))
	if lines[0]["rollout_id"] != "web-1" || lines[0]["result"] != nil || lines[0]["cursor"] == "" {
		t.Errorf("REST stream line = %v", lines[0])
	}
	if len(lines) > 1 {
		rest := restRows(t, ctx, h.rest+"/v1/rows:stream?after="+url.QueryEscape(lines[0]["cursor"].(string)), len(lines)-1)
		if rest[0]["cursor"] != lines[1]["cursor"] {
			t.Errorf("resumed after %v: first %v, want %v", lines[0]["cursor"], rest[0]["cursor"], lines[1]["cursor"])
		}
	}

	for _, tc := range []struct {
		path string
		code int
		says string
	}{
		{"/v1/rollouts/web-1/rows?merge=loose", http.StatusUnprocessableEntity, "merge"},
		{"/v1/rollouts/nobody/rows", http.StatusNotFound, "nobody"},
		{"/v1/rows:stream?after=garbage", http.StatusUnprocessableEntity, "after"},
	} {
		resp, body := httpGet(t, ctx, h.rest+tc.path)
		if resp.StatusCode != tc.code || !strings.Contains(string(body), tc.says) {
			t.Errorf("GET %s: %d %s, want %d naming %s", tc.path, resp.StatusCode, body, tc.code, tc.says)
		}
	}
}

func httpGet(t *testing.T, ctx context.Context, u string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, body
}

// restRows reads n lines of a REST rows stream and hangs up.
func restRows(t *testing.T, ctx context.Context, u string, n int) []map[string]any {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/x-ndjson" {
		t.Fatalf("GET %s: %d %s", u, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 16<<20)
	var out []map[string]any
	for len(out) < n && sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	if len(out) < n {
		t.Fatalf("GET %s: %d lines, want %d: %v", u, len(out), n, sc.Err())
	}
	return out
}

// TestRowsPolicyVocabSize: with the policy's vocabulary size configured, a
// call whose ids reach past it is a problem of its sample, named, and goes
// into no row; the rollout itself succeeds.
func TestRowsPolicyVocabSize(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.PolicyVocabSize = 10 }})
	r := h.runTokenRollout(t, "rows-vocab", 6, 7)
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
		t.Fatalf("rollout = %v", r)
	}
	got, err := h.client.GetRolloutRows(t.Context(), &rolloutv1.GetRolloutRowsRequest{RolloutId: "rows-vocab"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.GetRows()) != 0 || len(got.GetSamples()) != 1 || len(got.GetSamples()[0].GetProblems()) == 0 {
		t.Fatalf("rows = %v, want none and the sample's problems", got)
	}
	for _, p := range got.GetSamples()[0].GetProblems() {
		if !strings.Contains(p.GetReason(), "outside the vocabulary of 10") {
			t.Errorf("problem %v, want an id outside the vocabulary", p)
		}
	}
}
