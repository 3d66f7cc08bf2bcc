package osmoopenai_test

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/osmo-rl/osmo/integrations/osmoopenai"
	"github.com/osmo-rl/osmo/osmotest"
)

// A session's call carries the bound headers and the caller's options, and
// an HTTP error comes back as openai-go's *openai.Error, with the server's
// message, type, code and body.
func TestCompleteHeadersAndAPIError(t *testing.T) {
	var heads []http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		heads = append(heads, r.Header.Clone())
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = io.WriteString(w, `{"error":{"message":"the policy is full","type":"overloaded","code":"busy"}}`)
	}))
	t.Cleanup(srv.Close)
	ctx, _ := rolloutCtx(t, "r-1", func(string) string { return srv.URL + "/v1" })
	s, err := osmoopenai.NewSession(ctx, "a", option.WithHeader("X-Extra", "yes"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Complete(ctx, openai.ChatCompletionNewParams{Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(task)}})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("err = %v (%T), want an *openai.Error", err, err)
	}
	if apiErr.StatusCode != http.StatusTooManyRequests || apiErr.Message != "the policy is full" || apiErr.Code != "busy" || apiErr.Type != "overloaded" {
		t.Errorf("error %+v, want the server's 429 with its message, type and code", apiErr)
	}
	if b, _ := io.ReadAll(apiErr.Response.Body); !bytes.Contains(b, []byte("the policy is full")) {
		t.Errorf("the error's response body reads %q, want the server's", b)
	}
	if len(heads) != 1 {
		t.Fatalf("server got %d requests, want 1 (no client retries)", len(heads))
	}
	for k, want := range map[string]string{"Authorization": "Bearer " + token, "X-Rollout-Id": "r-1", "X-Sample-Id": "a", "Content-Type": "application/json", "X-Extra": "yes"} {
		if got := heads[0].Get(k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
}

// A reply that is not JSON fails the call, naming its content type, and
// leaves the session as it was.
func TestCompleteNotJSON(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = io.WriteString(w, "<html>gateway</html>")
	}))
	t.Cleanup(srv.Close)
	ctx, _ := rolloutCtx(t, "r-html", func(string) string { return srv.URL + "/v1" })
	s, err := osmoopenai.NewSession(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Complete(ctx, openai.ChatCompletionNewParams{Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(task)}})
	if err == nil || !strings.Contains(err.Error(), "text/html") {
		t.Fatalf("err = %v, want one naming the content type", err)
	}
	if _, err := osmotest.Messages(s); err != nil {
		t.Fatalf("a failed call spoils the session: %v", err)
	}
	if n := len(s.Items()); n != 1 {
		t.Errorf("session has %d items after a failed call, want the 1 sent", n)
	}
}
