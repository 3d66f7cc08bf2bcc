package osmoopenai_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
	"github.com/osmo-rl/osmo/osmotest"
)

func TestOutsideRolloutFails(t *testing.T) {
	ctx := testCtx(t)
	if _, err := osmoopenai.NewClient(ctx, "s1"); !errors.Is(err, osmo.ErrNoRollout) {
		t.Errorf("NewClient outside a rollout: err = %v, want osmo.ErrNoRollout", err)
	}
	if _, err := osmoopenai.NewSession(ctx, "s1"); !errors.Is(err, osmo.ErrNoRollout) {
		t.Errorf("NewSession outside a rollout: err = %v, want osmo.ErrNoRollout", err)
	}
}

func TestNewClientRejects(t *testing.T) {
	tests := []struct {
		name     string
		sampleID string
		baseURL  string
		want     string
	}{
		{name: "bad sample id", sampleID: "a/b", baseURL: "http://127.0.0.1:1/v1", want: `sample id "a/b"`},
		{name: "empty sample id", sampleID: "", baseURL: "http://127.0.0.1:1/v1", want: `sample id ""`},
		{name: "no endpoint", sampleID: "s1", baseURL: "", want: "no LLM endpoint"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, _ := rolloutCtx(t, "r1", func(string) string { return tc.baseURL })
			_, err := osmoopenai.NewClient(ctx, tc.sampleID)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "osmoopenai.NewClient: ") {
				t.Fatalf("err = %v, want one from osmoopenai.NewClient naming %q", err, tc.want)
			}
		})
	}
}

// The client carries the rollout's binding and nothing from the OPENAI_*
// environment, and leaves retries to the proxy.
func TestClientBinding(t *testing.T) {
	t.Setenv("OPENAI_API_KEY", "env-key")
	t.Setenv("OPENAI_ADMIN_KEY", "env-admin-key")
	t.Setenv("OPENAI_ORG_ID", "env-org")
	t.Setenv("OPENAI_PROJECT_ID", "env-project")
	t.Setenv("OPENAI_BASE_URL", "http://127.0.0.1:1/elsewhere")

	var requests atomic.Int64
	var got http.Header
	var path string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if requests.Add(1) == 1 {
			got, path = r.Header.Clone(), r.URL.Path
		}
		http.Error(w, `{"error":{"message":"boom"}}`, http.StatusInternalServerError)
	}))
	t.Cleanup(srv.Close)

	ctx, _ := rolloutCtx(t, "r-42", func(sampleID string) string { return srv.URL + "/bound/" + sampleID + "/v1" })
	c, err := osmoopenai.NewClient(ctx, "s-7")
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: osmoopenai.Model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusInternalServerError {
		t.Fatalf("err = %v, want the server's 500", err)
	}
	if n := requests.Load(); n != 1 {
		t.Errorf("server got %d requests, want 1 (no client retries)", n)
	}
	if path != "/bound/s-7/v1/chat/completions" {
		t.Errorf("path = %q, want the endpoint's base URL + /chat/completions", path)
	}
	for k, want := range map[string]string{
		"Authorization":       "Bearer " + token,
		"X-Rollout-Id":        "r-42",
		"X-Sample-Id":         "s-7",
		"Openai-Organization": "",
		"Openai-Project":      "",
	} {
		if v := got.Get(k); v != want {
			t.Errorf("header %s = %q, want %q", k, v, want)
		}
	}
}

// The endpoint's own headers are sent, but cannot rebind the sample.
func TestClientEndpointHeaders(t *testing.T) {
	var got http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Clone()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(completion(`{"role":"assistant","content":"ok"}`)))
	}))
	t.Cleanup(srv.Close)
	r := osmotest.NewRollout("r1", runtime{endpoint: func(sampleID string) osmo.Endpoint {
		return osmo.Endpoint{
			BaseURL:    srv.URL + "/v1",
			Headers:    map[string]string{"x-sample-id": "someone-else", "x-extra": "yes"},
			HTTPClient: srv.Client(),
		}
	}})
	ctx := osmotest.ContextWithRollout(testCtx(t), r)
	c, err := osmoopenai.NewClient(ctx, "mine")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: osmoopenai.Model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}}); err != nil {
		t.Fatal(err)
	}
	if got.Get("X-Sample-Id") != "mine" || got.Get("X-Extra") != "yes" || got.Get("Authorization") != "" {
		t.Errorf("headers x-sample-id %q x-extra %q authorization %q, want mine, yes and none", got.Get("X-Sample-Id"), got.Get("X-Extra"), got.Get("Authorization"))
	}
}
