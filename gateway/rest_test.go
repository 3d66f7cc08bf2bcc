package gateway_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// response is an HTTP answer read in full.
type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("body is not a JSON object: %v\n%s", err, r.body)
	}
	return m
}

// detail returns the "detail" of a FastAPI error body, failing unless the
// body is exactly {"detail": string}.
func (r response) detail(t *testing.T) string {
	t.Helper()
	m := r.json(t)
	if keys := sortedKeys(m); !slices.Equal(keys, []string{"detail"}) {
		t.Fatalf("error body keys = %v, want [detail]; body %s", keys, r.body)
	}
	d, ok := m["detail"].(string)
	if !ok {
		t.Fatalf("detail is %T, want string", m["detail"])
	}
	return d
}

func sortedKeys(m map[string]any) []string {
	return slices.Sorted(maps.Keys(m))
}

func (h *harness) do(t *testing.T, method, path, body string, header http.Header) response {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	return h.send(t, method, path, rd, header)
}

func (h *harness) send(t *testing.T, method, path string, body io.Reader, header http.Header) response {
	t.Helper()
	req, err := http.NewRequestWithContext(testContext(t), method, h.restURL+path, body)
	if err != nil {
		t.Fatalf("NewRequest: %v", err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, vs := range header {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	resp, err := h.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return response{status: resp.StatusCode, header: resp.Header, body: b}
}

const initBody = `{
  "rollout_id": "r-1",
  "server_url": "http://127.0.0.1:9/controller",
  "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
  "completion_params": {"temperature": 0.7, "max_tokens": 512},
  "tool_server_url": null,
  "max_turns": 5,
  "max_tokens_total": 8192,
  "metadata": {"task": "math", "nested": [1, {"b": null}]},
  "api_key": null,
  "idempotency_key": "idem-1",
  "osmosis_extra": {"sent": "by a newer client"}
}`

func TestInitRolloutAnswers202WithExactBody(t *testing.T) {
	h := newHarness(t, nil)
	resp := h.do(t, http.MethodPost, "/v1/rollout/init", initBody, nil)

	if resp.status != http.StatusAccepted {
		t.Fatalf("status = %d, want 202; body %s", resp.status, resp.body)
	}
	if ct := resp.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", ct)
	}
	got := resp.json(t)
	want := map[string]any{
		"rollout_id": "r-1",
		"tools": []any{map[string]any{
			"type": "function",
			"function": map[string]any{
				"name":        "add",
				"description": "Add two numbers.",
				"parameters": map[string]any{
					"type":       "object",
					"properties": map[string]any{"a": map[string]any{"type": "number"}},
					"required":   []any{"a"},
				},
			},
		}},
	}
	if keys := sortedKeys(got); !slices.Equal(keys, []string{"rollout_id", "tools"}) {
		t.Errorf("keys = %v, want [rollout_id tools]", keys)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("body = %v\nwant %v", got, want)
	}

	// The snake_case fields reached the service; the unknown one was dropped.
	req := h.rollout.init()
	if req == nil {
		t.Fatal("InitRollout was not called")
	}
	if req.GetServerUrl() != "http://127.0.0.1:9/controller" || req.GetMaxTurns() != 5 ||
		req.GetMaxTokensTotal() != 8192 || req.GetIdempotencyKey() != "idem-1" {
		t.Errorf("request fields lost: %v", req)
	}
	if req.ToolServerUrl != nil || req.ApiKey != nil {
		t.Errorf("null optional fields were set: tool_server_url=%v api_key=%v", req.ToolServerUrl, req.ApiKey)
	}
	if got := req.GetMetadata().AsMap()["task"]; got != "math" {
		t.Errorf("metadata.task = %v, want math", got)
	}
	if got := req.GetCompletionParams().AsMap()["temperature"]; got != 0.7 {
		t.Errorf("completion_params.temperature = %v, want 0.7", got)
	}
	if n := len(req.GetMessages()); n != 2 {
		t.Errorf("messages = %d, want 2", n)
	}
}

func TestHealthBodyIsOsmosisShape(t *testing.T) {
	h := newHarness(t, nil)
	resp := h.do(t, http.MethodGet, "/health", "", nil)
	if resp.status != http.StatusOK {
		t.Fatalf("status = %d; body %s", resp.status, resp.body)
	}
	got := resp.json(t)
	want := map[string]any{
		"status":             "healthy",
		"agent_loop":         "echo",
		"active_rollouts":    float64(3), // JSON numbers, not strings
		"completed_rollouts": float64(7),
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("body = %v, want %v", got, want)
	}
}

func TestRolloutJSONUsesProtoNamesAndOmitsUnsetOptionals(t *testing.T) {
	h := newHarness(t, nil)

	t.Run("unset optional omitted, everything else emitted", func(t *testing.T) {
		// TE: trailers invites grpc-gateway to forward trailers; none may leak.
		resp := h.do(t, http.MethodGet, "/v1/rollouts/plain", "", http.Header{"Te": {"trailers"}})
		if resp.status != http.StatusOK {
			t.Fatalf("status = %d; body %s", resp.status, resp.body)
		}
		got := resp.json(t)
		wantKeys := []string{
			"callback_error", "created_at", "error_category", "error_message", "finish_reason",
			"finished_at", "metadata", "metrics", "policy_versions", "rollout_id", "samples", "sequence",
			"stale", "started_at", "state", "wire", "workflow",
		}
		if keys := sortedKeys(got); !slices.Equal(keys, wantKeys) {
			t.Errorf("keys = %v\nwant %v", keys, wantKeys)
		}
		if got["metadata"] != nil || got["created_at"] != nil {
			t.Errorf("unset messages should be null: metadata=%v created_at=%v", got["metadata"], got["created_at"])
		}
		if s, ok := got["samples"].([]any); !ok || len(s) != 0 {
			t.Errorf("samples = %#v, want []", got["samples"])
		}
		metrics, _ := got["metrics"].(map[string]any)
		if metrics["num_llm_calls"] != float64(2) {
			t.Errorf("metrics = %v, want num_llm_calls 2", metrics)
		}
		if got["state"] != "STATE_SUCCEEDED" {
			t.Errorf("state = %v", got["state"])
		}
		for k := range resp.header {
			lk := strings.ToLower(k)
			if strings.HasPrefix(lk, "grpc-") || strings.Contains(lk, "internal") || lk == "trailer" {
				t.Errorf("service metadata leaked as header %s: %v", k, resp.header[k])
			}
		}
	})

	t.Run("set optional emitted", func(t *testing.T) {
		resp := h.do(t, http.MethodGet, "/v1/rollouts/graded", "", nil)
		if got := resp.json(t)["reward"]; got != 0.5 {
			t.Errorf("reward = %v, want 0.5", got)
		}
	})
}

// TestRolloutStatusListsEveryKey: the G3 status body always carries
// reward and err_message (and err_category), null while unset, in the
// order of the protocol.
func TestRolloutStatusListsEveryKey(t *testing.T) {
	h := newHarness(t, nil)
	for _, tc := range []struct{ id, want string }{
		{"q-1", `{"rollout_id":"q-1","status":"queued","reward":null,"err_message":null,"err_category":null}`},
		{"failed", `{"rollout_id":"failed","status":"failure","reward":0,"err_message":"grading failed","err_category":"agent_error"}`},
	} {
		resp := h.do(t, http.MethodGet, "/rollout/"+tc.id+"/status", "", nil)
		if resp.status != http.StatusOK {
			t.Fatalf("%s: status = %d; body %s", tc.id, resp.status, resp.body)
		}
		if string(resp.body) != tc.want {
			t.Errorf("%s: body = %s\nwant %s", tc.id, resp.body, tc.want)
		}
		if ct := resp.header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s: Content-Type = %q", tc.id, ct)
		}
	}
}

func TestStatusMapping(t *testing.T) {
	cases := []struct {
		code       codes.Code
		httpStatus int
	}{
		{codes.InvalidArgument, 422},
		{codes.Unauthenticated, 401},
		{codes.PermissionDenied, 403},
		{codes.NotFound, 404},
		{codes.AlreadyExists, 409},
		{codes.FailedPrecondition, 400},
		{codes.ResourceExhausted, 429},
		{codes.Canceled, 499},
		{codes.DeadlineExceeded, 504},
		{codes.Unavailable, 503},
		{codes.Unimplemented, 501},
		{codes.Internal, 500},
		{codes.Unknown, 500},
		{codes.Aborted, 500},
		{codes.OutOfRange, 500},
		{codes.DataLoss, 500},
	}
	fake := &fakeRollout{errs: map[string]error{}}
	for _, c := range cases {
		fake.errs[c.code.String()] = status.Errorf(c.code, "%s <failure> & more", c.code)
	}
	h := newHarness(t, fake)

	for _, c := range cases {
		t.Run(c.code.String(), func(t *testing.T) {
			resp := h.do(t, http.MethodGet, "/v1/rollouts/"+c.code.String(), "", nil)
			if resp.status != c.httpStatus {
				t.Errorf("status = %d, want %d", resp.status, c.httpStatus)
			}
			if ct := resp.header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type = %q", ct)
			}
			if want := c.code.String() + " <failure> & more"; resp.detail(t) != want {
				t.Errorf("detail = %q, want %q", resp.detail(t), want)
			}
			wantRetry := ""
			if c.code == codes.ResourceExhausted {
				wantRetry = "5"
			}
			if got := resp.header.Get("Retry-After"); got != wantRetry {
				t.Errorf("Retry-After = %q, want %q", got, wantRetry)
			}
		})
	}
}

func TestUnauthenticatedBodyIsExact(t *testing.T) {
	h := newHarness(t, &fakeRollout{requireKey: true})

	resp := h.do(t, http.MethodPost, "/v1/rollout/init", initBody, nil)
	if resp.status != http.StatusUnauthorized {
		t.Fatalf("status = %d, want 401", resp.status)
	}
	if want := `{"detail":"Invalid or missing API key"}`; string(resp.body) != want {
		t.Errorf("body = %s, want %s", resp.body, want)
	}
	if got := resp.header.Get("WWW-Authenticate"); got != "Bearer" {
		t.Errorf("WWW-Authenticate = %q, want Bearer", got)
	}

	resp = h.do(t, http.MethodPost, "/v1/rollout/init", initBody, http.Header{"Authorization": {apiKey}})
	if resp.status != http.StatusAccepted {
		t.Errorf("with the key: status = %d, want 202; body %s", resp.status, resp.body)
	}
}

func TestRoutingErrors(t *testing.T) {
	h := newHarness(t, nil)
	cases := []struct {
		name, method, path string
		status             int
		detail             string
	}{
		{"unknown path", http.MethodGet, "/v2/nothing", 404, "Not Found"},
		{"wrong method", http.MethodGet, "/v1/rollout/init", 405, "Method Not Allowed"},
		{"wrong method on health", http.MethodDelete, "/health", 405, "Method Not Allowed"},
		{"openapi wrong method", http.MethodPost, "/openapi.json", 405, "Method Not Allowed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := h.do(t, c.method, c.path, "", nil)
			if resp.status != c.status {
				t.Errorf("status = %d, want %d", resp.status, c.status)
			}
			if got := resp.detail(t); got != c.detail {
				t.Errorf("detail = %q, want %q", got, c.detail)
			}
		})
	}
}

// onlyReader hides the length of a body so it is sent chunked.
type onlyReader struct{ io.Reader }

func TestBodyLimit(t *testing.T) {
	const limit = 1024
	h := newHarness(t, nil, withMaxBodyBytes(limit))
	big := `{"rollout_id": "r", "metadata": {"pad": "` + strings.Repeat("x", limit) + `"}}`

	cases := []struct {
		name string
		body io.Reader
	}{
		{"declared length", strings.NewReader(big)},
		{"chunked", onlyReader{strings.NewReader(big)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := h.send(t, http.MethodPost, "/v1/rollout/init", c.body, nil)
			if resp.status != http.StatusRequestEntityTooLarge {
				t.Fatalf("status = %d, want 413; body %s", resp.status, resp.body)
			}
			if got, want := resp.detail(t), "request body exceeds 1024 bytes"; got != want {
				t.Errorf("detail = %q, want %q", got, want)
			}
		})
	}
	if h.md.called(rolloutv1.RolloutService_InitRollout_FullMethodName) {
		t.Error("an oversized request reached the service")
	}

	// A body just under the limit still goes through.
	small := `{"rollout_id": "r", "metadata": {"pad": "` + strings.Repeat("x", limit-100) + `"}}`
	if resp := h.do(t, http.MethodPost, "/v1/rollout/init", small, nil); resp.status != http.StatusAccepted {
		t.Errorf("body under the limit: status = %d; body %s", resp.status, resp.body)
	}
}

func TestBadJSONNamesTheField(t *testing.T) {
	h := newHarness(t, nil)
	cases := []struct {
		name, path, body, detail string
	}{
		{"metadata array", "/v1/rollout/init",
			`{"rollout_id": "r", "metadata": []}`,
			"metadata: must be a JSON object, got array"},
		{"message element string", "/v1/rollout/init",
			`{"rollout_id": "r", "messages": [{"role": "user"}, {}, "hi"]}`,
			"messages[2]: must be a JSON object, got string"},
		{"message element null", "/v1/rollout/init",
			`{"messages": [null]}`,
			"messages[0]: must be a JSON object, got null"},
		{"messages object", "/v1/rollout/init",
			`{"messages": {"role": "user"}}`,
			"messages: must be a JSON array, got object"},
		{"invalid UTF-8", "/v1/rollout/init",
			"{\"rollout_id\": \"r\xff\"}",
			"rollout_id: must be valid UTF-8"},
		{"rollout_id number", "/v1/rollout/init",
			`{"rollout_id": 42}`,
			"rollout_id: must be a string, got number"},
		{"max_turns word", "/v1/rollout/init",
			`{"max_turns": "ten"}`,
			"max_turns: must be an integer, got string"},
		{"max_turns camelCase name", "/v1/rollout/init",
			`{"maxTurns": true}`,
			"max_turns: must be an integer, got boolean"},
		{"max_turns fraction", "/v1/rollout/init",
			`{"max_turns": 1.5}`,
			"max_turns: must be an integer, got 1.5"},
		{"max_turns out of range", "/v1/rollout/init",
			`{"max_turns": 1e20}`,
			"max_turns: out of range for int32: 1e20"},
		{"completion_params string", "/v1/rollout/init",
			`{"completion_params": "hot"}`,
			"completion_params: must be a JSON object, got string"},
		{"body not an object", "/v1/rollout/init",
			`["r"]`,
			"request body: must be a JSON object, got array"},
		{"duplicate field", "/v1/rollout/init",
			`{"rolloutId": "a", "rollout_id": "b"}`,
			`request body: duplicate field "rollout_id"`},
		{"nested integer", "/v1/grade",
			`{"rollout_id": "r", "samples": [{"id": "s", "metrics": {"num_llm_calls": "many"}}]}`,
			"samples[0].metrics.num_llm_calls: must be an integer, got string"},
		{"nested repeated integer", "/v1/grade",
			`{"samples": [{"llm_calls": [{"prompt_token_ids": [1, "x"]}]}]}`,
			"samples[0].llm_calls[0].prompt_token_ids[1]: must be an integer, got string"},
		{"timestamp kind", "/v1/grade",
			`{"samples": [{"llm_calls": [{"started_at": 5}]}]}`,
			"samples[0].llm_calls[0].started_at: must be an RFC 3339 timestamp string, got number"},
		{"timestamp format", "/v1/grade",
			`{"samples": [{"llm_calls": [{"started_at": "yesterday"}]}]}`,
			`samples[0].llm_calls[0].started_at: invalid google.protobuf.Timestamp value "yesterday"`},
		{"double", "/v1/grade",
			`{"samples": [{"reward": "high"}]}`,
			"samples[0].reward: must be a number, got string"},
		{"bool", "/v1/grade",
			`{"samples": [{"remove_sample": "yes"}]}`,
			"samples[0].remove_sample: must be a boolean, got string"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := h.do(t, http.MethodPost, c.path, c.body, nil)
			if resp.status != http.StatusUnprocessableEntity {
				t.Fatalf("status = %d, want 422; body %s", resp.status, resp.body)
			}
			if got := resp.detail(t); got != c.detail {
				t.Errorf("detail = %q\nwant     %q", got, c.detail)
			}
		})
	}

	syntax := []struct{ name, body string }{
		{"trailing comma", `{"rollout_id": "a",}`},
		{"truncated", `{"rollout_id": `},
		{"garbage after the object", `{"rollout_id": "a"} x`},
	}
	for _, c := range syntax {
		t.Run(c.name, func(t *testing.T) {
			resp := h.do(t, http.MethodPost, "/v1/rollout/init", c.body, nil)
			if resp.status != http.StatusUnprocessableEntity {
				t.Fatalf("status = %d, want 422; body %s", resp.status, resp.body)
			}
			if got := resp.detail(t); !strings.HasPrefix(got, "request body: invalid JSON: ") {
				t.Errorf("detail = %q, want a request body: invalid JSON: ... message", got)
			}
		})
	}

	for _, m := range []string{rolloutv1.RolloutService_InitRollout_FullMethodName, "/osmo.grader.v1.GraderService/Grade"} {
		if h.md.called(m) {
			t.Errorf("an invalid request reached %s", m)
		}
	}
}

func TestValidJSONVariantsAreAccepted(t *testing.T) {
	h := newHarness(t, nil)
	cases := []struct{ name, body string }{
		{"integer as a decimal string", `{"rollout_id": "r", "max_turns": "10"}`},
		{"integer in exponent form", `{"rollout_id": "r", "max_turns": 1e1}`},
		{"null for every kind", `{"rollout_id": "r", "messages": null, "metadata": null, "max_turns": null}`},
		{"any JSON inside metadata", `{"rollout_id": "r", "metadata": {"a": [1, "x", null, {"b": [true]}]}}`},
		{"camelCase names", `{"rolloutId": "r", "serverUrl": "http://x"}`},
		{"unknown fields", `{"rollout_id": "r", "future_field": {"x": [1]}, "other": 1}`},
		{"empty body", ``},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := h.do(t, http.MethodPost, "/v1/rollout/init", c.body, nil)
			if resp.status != http.StatusAccepted {
				t.Errorf("status = %d, want 202; body %s", resp.status, resp.body)
			}
		})
	}
}

func TestHeaderAllowlistREST(t *testing.T) {
	h := newHarness(t, nil)
	header := http.Header{
		"Authorization":          {"Bearer abc"},
		"X-Rollout-Id":           {"r-7"},
		"X-Sample-Id":            {"s-1"},
		"X-Request-Id":           {"req-1"},
		"Traceparent":            {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		"Tracestate":             {"osmo=1"},
		"Baggage":                {"team=rl"},
		"Idempotency-Key":        {"idem-9"},
		"X-Not-Allowed":          {"nope"},
		"Cookie":                 {"session=1"},
		"Grpc-Metadata-Smuggled": {"nope"},
	}
	resp := h.do(t, http.MethodPost, "/v1/rollout/init", initBody, header)
	if resp.status != http.StatusAccepted {
		t.Fatalf("status = %d; body %s", resp.status, resp.body)
	}
	md := h.md.last(t, rolloutv1.RolloutService_InitRollout_FullMethodName)
	for key, want := range map[string]string{
		"authorization":   "Bearer abc",
		"x-rollout-id":    "r-7",
		"x-sample-id":     "s-1",
		"x-request-id":    "req-1",
		"traceparent":     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"tracestate":      "osmo=1",
		"baggage":         "team=rl",
		"idempotency-key": "idem-9",
	} {
		if got := md.Get(key); !slices.Equal(got, []string{want}) {
			t.Errorf("metadata %s = %q, want exactly [%q]", key, got, want)
		}
	}
	for key := range md {
		if key == "x-not-allowed" || key == "smuggled" || key == "cookie" || strings.HasPrefix(key, "grpcgateway-") {
			t.Errorf("header %s was forwarded", key)
		}
	}
}

func TestWatchRolloutsREST(t *testing.T) {
	fake := &fakeRollout{
		watch: []*rolloutv1.Rollout{
			{RolloutId: "a", Sequence: 6, State: rolloutv1.State_STATE_SUCCEEDED},
			{RolloutId: "b", Sequence: 7, State: rolloutv1.State_STATE_FAILED},
		},
	}
	h := newHarness(t, fake)

	lines := readLines(t, h.do(t, http.MethodGet, "/v1/rollouts:watch?after_sequence=5", "", nil))
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2: %v", len(lines), lines)
	}
	for i, id := range []string{"a", "b"} {
		result, ok := lines[i]["result"].(map[string]any)
		if !ok || result["rollout_id"] != id {
			t.Errorf("line %d = %v, want result with rollout_id %s", i, lines[i], id)
		}
	}
	if got := fake.watchRequest().GetAfterSequence(); got != 5 {
		t.Errorf("after_sequence = %d, want 5", got)
	}
}

func TestWatchRolloutsRESTErrorMidStream(t *testing.T) {
	fake := &fakeRollout{
		watch:    []*rolloutv1.Rollout{{RolloutId: "a"}},
		watchErr: status.Error(codes.Internal, "store lost"),
	}
	h := newHarness(t, fake)

	lines := readLines(t, h.do(t, http.MethodGet, "/v1/rollouts:watch", "", nil))
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2: %v", len(lines), lines)
	}
	errChunk, ok := lines[1]["error"].(map[string]any)
	if !ok || errChunk["message"] != "store lost" || errChunk["code"] != float64(codes.Internal) {
		t.Errorf("last line = %v, want an error chunk for Internal: store lost", lines[1])
	}
}

// readLines parses a newline-delimited JSON stream.
func readLines(t *testing.T, resp response) []map[string]any {
	t.Helper()
	if resp.status != http.StatusOK {
		t.Fatalf("status = %d; body %s", resp.status, resp.body)
	}
	var lines []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(resp.body))
	for sc.Scan() {
		if len(bytes.TrimSpace(sc.Bytes())) == 0 {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		lines = append(lines, m)
	}
	return lines
}

func TestGradeREST(t *testing.T) {
	h := newHarness(t, nil)
	resp := h.do(t, http.MethodPost, "/v1/grade", `{"rollout_id": "r", "grader": "exact", "samples": [{"id": "s1"}, {"id": "s2"}]}`, nil)
	if resp.status != http.StatusOK {
		t.Fatalf("status = %d; body %s", resp.status, resp.body)
	}
	got := resp.json(t)
	grades, _ := got["grades"].([]any)
	if got["rollout_id"] != "r" || got["grader"] != "exact" || len(grades) != 2 {
		t.Errorf("body = %v", got)
	}
}

func TestGraderNotConfigured(t *testing.T) {
	h := newHarness(t, nil, withoutGrader())
	resp := h.do(t, http.MethodPost, "/v1/grade", `{"rollout_id": "r"}`, nil)
	if resp.status != http.StatusServiceUnavailable {
		t.Fatalf("status = %d, want 503; body %s", resp.status, resp.body)
	}
	if got, want := resp.detail(t), "grader service is not configured on this gateway"; got != want {
		t.Errorf("detail = %q, want %q", got, want)
	}
	// The rollout routes are unaffected.
	if resp := h.do(t, http.MethodGet, "/health", "", nil); resp.status != http.StatusOK {
		t.Errorf("health: status = %d", resp.status)
	}
}

func TestOpenAPIDocument(t *testing.T) {
	h := newHarness(t, nil)
	resp := h.do(t, http.MethodGet, "/openapi.json", "", nil)
	if resp.status != http.StatusOK {
		t.Fatalf("status = %d", resp.status)
	}
	if ct := resp.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("Content-Type = %q", ct)
	}
	var doc struct {
		Swagger string                    `json:"swagger"`
		Paths   map[string]map[string]any `json:"paths"`
	}
	if err := json.Unmarshal(resp.body, &doc); err != nil {
		t.Fatalf("not JSON: %v", err)
	}
	if doc.Swagger != "2.0" {
		t.Errorf("swagger = %q", doc.Swagger)
	}
	if _, ok := doc.Paths["/v1/rollout/init"]["post"]; !ok {
		t.Errorf("paths lack POST /v1/rollout/init: %v", slices.Sorted(maps.Keys(doc.Paths)))
	}
}

func TestWatchRolloutsRESTFailingAtOnce(t *testing.T) {
	h := newHarness(t, &fakeRollout{watchErr: status.Error(codes.InvalidArgument, "after_sequence: too old")})
	resp := h.do(t, http.MethodGet, "/v1/rollouts:watch?after_sequence=1", "", nil)
	if resp.status != http.StatusUnprocessableEntity {
		t.Fatalf("status = %d, want 422; body %s", resp.status, resp.body)
	}
	if got, want := resp.detail(t), "after_sequence: too old"; got != want {
		t.Errorf("detail = %q, want %q", got, want)
	}
}

func TestWatchRolloutsRESTEmpty(t *testing.T) {
	h := newHarness(t, nil)
	resp := h.do(t, http.MethodGet, "/v1/rollouts:watch", "", nil)
	if resp.status != http.StatusOK || len(bytes.TrimSpace(resp.body)) != 0 {
		t.Errorf("status = %d, body %q; want 200 and no lines", resp.status, resp.body)
	}
}

func TestWatchRolloutsRESTBadQuery(t *testing.T) {
	h := newHarness(t, nil)
	resp := h.do(t, http.MethodGet, "/v1/rollouts:watch?after_sequence=soon", "", nil)
	if resp.status != http.StatusUnprocessableEntity {
		t.Fatalf("status = %d, want 422; body %s", resp.status, resp.body)
	}
	if got := resp.detail(t); !strings.Contains(got, "after_sequence") {
		t.Errorf("detail = %q, want it to name after_sequence", got)
	}
}
