package osmoeino_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/osmotest"
)

const (
	testRolloutID = "rollout-1"
	testToken     = "tok-rollout-1"
	task          = "What is 6 times 7?"
)

// seen is one request the upstream received.
type seen struct {
	header http.Header
	body   map[string]any
}

// upstream is the mock policy on loopback, keeping every request it got.
type upstream struct {
	mock *mockllm.Server
	url  string

	mu   sync.Mutex
	reqs []seen
}

func newUpstream(t *testing.T, opts mockllm.Options) *upstream {
	t.Helper()
	mock, err := mockllm.New(opts)
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	u := &upstream{mock: mock}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var m map[string]any
		_ = json.Unmarshal(body, &m)
		u.mu.Lock()
		u.reqs = append(u.reqs, seen{header: r.Header.Clone(), body: m})
		u.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body))
		mock.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	u.url = srv.URL
	return u
}

func (u *upstream) requests() []seen {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]seen(nil), u.reqs...)
}

// runtime is a osmo.Runtime whose endpoint is given by the test.
type runtime struct {
	endpoint func(sampleID string) osmo.Endpoint

	mu    sync.Mutex
	asked []string
}

func (rt *runtime) Endpoint(sampleID string) osmo.Endpoint {
	rt.mu.Lock()
	rt.asked = append(rt.asked, sampleID)
	rt.mu.Unlock()
	return rt.endpoint(sampleID)
}

func (rt *runtime) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (rt *runtime) LogEvent(string, map[string]any)      {}
func (rt *runtime) RecordToolCall(string, time.Duration) {}

func (rt *runtime) askedFor() []string {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return append([]string(nil), rt.asked...)
}

// upstreamRuntime sends every sample straight to u.
func upstreamRuntime(u *upstream) *runtime {
	return &runtime{endpoint: func(string) osmo.Endpoint {
		return osmo.Endpoint{BaseURL: u.url + "/v1", APIKey: testToken}
	}}
}

// inRollout returns a bounded context carrying a new rollout on rt.
func inRollout(t *testing.T, rt osmo.Runtime) (context.Context, *osmo.Rollout) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	r := osmotest.NewRollout(testRolloutID, rt)
	return osmotest.ContextWithRollout(ctx, r), r
}

// multiplyInfo is the multiply tool as the mock policy understands it.
func multiplyInfo() *schema.ToolInfo {
	return &schema.ToolInfo{
		Name: "multiply",
		Desc: "Multiply two numbers",
		ParamsOneOf: schema.NewParamsOneOfByParams(map[string]*schema.ParameterInfo{
			"a": {Type: schema.Number, Required: true},
			"b": {Type: schema.Number, Required: true},
		}),
	}
}

// jsonMessages decodes a JSON array of messages.
func jsonMessages(t *testing.T, s string) []osmo.Message {
	t.Helper()
	var out []osmo.Message
	if err := json.Unmarshal([]byte(s), &out); err != nil {
		t.Fatalf("bad test JSON %s: %v", s, err)
	}
	return out
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return "<" + err.Error() + ">"
	}
	return string(b)
}

// sampleOf returns the messages of the rollout's only source.
func sampleOf(t *testing.T, r *osmo.Rollout) []osmo.Message {
	t.Helper()
	srcs := osmotest.Sources(r)
	if len(srcs) != 1 {
		t.Fatalf("rollout has %d sample sources, want 1", len(srcs))
	}
	msgs, err := osmotest.Messages(srcs[0].Source)
	if err != nil {
		t.Fatalf("SampleMessages: %v", err)
	}
	return msgs
}
