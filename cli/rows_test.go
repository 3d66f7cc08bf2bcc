package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// --training-rows is on unless turned off, and reaches the rollout service's Config.
func TestRowsFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want bool
	}{
		{nil, true},
		{[]string{"--training-rows=false"}, false},
		{[]string{"--training-rows"}, true},
	} {
		e := &env{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }, reg: newRegistry(nil)}
		var f rolloutFlags
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		if err := f.register(fs, e); err != nil {
			t.Fatal(err)
		}
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		cfg, err := f.config(e, slog.New(slog.DiscardHandler), nil, "", nil, nil, tracing{})
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if cfg.Rows != tc.want {
			t.Errorf("%v: Config.Rows = %v, want %v", tc.args, cfg.Rows, tc.want)
		}
	}
}

// osmo llmproxy asks the policy for tokens unless --training-rows=false.
func TestLLMProxyRowsFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		ask  bool
	}{
		{nil, true},
		{[]string{"--training-rows=false"}, false},
	} {
		var (
			mu     sync.Mutex
			bodies []string
		)
		policy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			mu.Lock()
			bodies = append(bodies, string(b))
			mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop"}]}`)
		}))
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		var out logtest.Buffer
		e := &env{stdout: &out, stderr: &out, getenv: func(string) string { return "" }, reg: newRegistry(nil)}
		done := make(chan error, 1)
		go func() {
			done <- commands()["llmproxy"].run(ctx, e, append([]string{"--addr", "127.0.0.1:0", "--upstream", policy.URL + "/v1"}, tc.args...))
		}()
		base := ""
		for base == "" {
			recs, _ := out.Records()
			for _, r := range recs {
				if r["msg"] == "llm proxy serving" {
					base, _ = r["http"].(string)
				}
			}
			select {
			case err := <-done:
				t.Fatalf("llmproxy %v ended: %v\n%s", tc.args, err, out.String())
			case <-ctx.Done():
				t.Fatalf("llmproxy %v did not start:\n%s", tc.args, out.String())
			case <-time.After(20 * time.Millisecond):
			}
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, strings.Replace(base, "0.0.0.0", "127.0.0.1", 1)+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set(llmproxy.HeaderRolloutID, "r1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("llmproxy %v: %v", tc.args, err)
		}
		policy.Close()
		mu.Lock()
		got := slices.Clone(bodies)
		mu.Unlock()
		if resp.StatusCode != http.StatusOK || len(got) != 1 {
			t.Fatalf("llmproxy %v: status %d, %d upstream calls", tc.args, resp.StatusCode, len(got))
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal([]byte(got[0]), &m); err != nil {
			t.Fatal(err)
		}
		if _, asked := m["return_token_ids"]; asked != tc.ask {
			t.Errorf("llmproxy %v: upstream body %s; want return_token_ids asked: %v", tc.args, got[0], tc.ask)
		}
	}
}
