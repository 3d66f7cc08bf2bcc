package osmoopenai_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/osmo-rl/osmo/integrations/osmoopenai"
)

// A session without request options posts its calls itself; one with
// options goes through openai-go. The server sees the same body and the
// same bound headers from both, and the caller the same reply and the
// same *openai.Error.
func TestSessionPathsAgree(t *testing.T) {
	var (
		mu     sync.Mutex
		bodies [][]byte
		heads  []http.Header
		status = http.StatusOK
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies, heads = append(bodies, b), append(heads, r.Header.Clone())
		st := status
		mu.Unlock()
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if st != http.StatusOK {
			w.WriteHeader(st)
			_, _ = io.WriteString(w, `{"error":{"message":"the policy is full","type":"overloaded","code":"busy"}}`)
			return
		}
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"42"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}))
	t.Cleanup(srv.Close)

	params := openai.ChatCompletionNewParams{Temperature: openai.Float(0.5), MaxTokens: openai.Int(7),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage(task)}}
	complete := func(name string, opts ...option.RequestOption) (*openai.ChatCompletion, error) {
		ctx, _ := rolloutCtx(t, "r-"+name, func(string) string { return srv.URL + "/v1" })
		s, err := osmoopenai.NewSession(ctx, name, opts...)
		if err != nil {
			t.Fatal(err)
		}
		return s.Complete(ctx, params)
	}
	direct, err := complete("direct")
	if err != nil {
		t.Fatal(err)
	}
	viaSDK, err := complete("sdk", option.WithHeader("X-Extra", "yes"))
	if err != nil {
		t.Fatal(err)
	}
	if direct.Choices[0].Message.Content != "42" || direct.Usage.TotalTokens != 4 || direct.RawJSON() != viaSDK.RawJSON() {
		t.Errorf("direct reply %q (usage %d), want the SDK's %q", direct.RawJSON(), direct.Usage.TotalTokens, viaSDK.RawJSON())
	}
	mu.Lock()
	if len(bodies) != 2 || !jsonEqual(t, bodies[0], bodies[1]) {
		t.Errorf("bodies differ:\n direct %s\n sdk    %s", bodies[0], bodies[1])
	}
	for i, name := range []string{"direct", "sdk"} {
		h := heads[i]
		for k, want := range map[string]string{"Authorization": "Bearer " + token, "X-Rollout-Id": "r-" + name, "X-Sample-Id": name, "Content-Type": "application/json"} {
			if got := h.Get(k); got != want {
				t.Errorf("%s: %s = %q, want %q", name, k, got, want)
			}
		}
	}
	if heads[1].Get("X-Extra") != "yes" {
		t.Errorf("the session with options did not send them: %v", heads[1])
	}
	status = http.StatusTooManyRequests
	mu.Unlock()

	for _, name := range []string{"direct-err", "sdk-err"} {
		var opts []option.RequestOption
		if strings.HasPrefix(name, "sdk") {
			opts = append(opts, option.WithHeader("X-Extra", "yes"))
		}
		_, err := complete(name, opts...)
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) {
			t.Fatalf("%s: err = %v (%T), want an *openai.Error", name, err, err)
		}
		if apiErr.StatusCode != http.StatusTooManyRequests || apiErr.Message != "the policy is full" || apiErr.Code != "busy" || apiErr.Type != "overloaded" {
			t.Errorf("%s: error %+v, want the server's 429 with its message, type and code", name, apiErr)
		}
		if b, _ := io.ReadAll(apiErr.Response.Body); !bytes.Contains(b, []byte("the policy is full")) {
			t.Errorf("%s: the error's response body reads %q, want the server's", name, b)
		}
	}
}

// A reply that is not JSON fails the call with what it was.
func TestSessionDirectNotJSON(t *testing.T) {
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
	if err == nil || !strings.Contains(err.Error(), "text/html") || !strings.Contains(err.Error(), "<html>gateway</html>") {
		t.Fatalf("err = %v, want one naming the content type and the body", err)
	}
	if _, err := s.SampleMessages(); err != nil {
		t.Fatalf("a failed call spoils the session: %v", err)
	}
	if n := len(s.Items()); n != 1 {
		t.Errorf("session has %d items after a failed call, want the 1 sent", n)
	}
}

func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}
