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
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/logtest"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// --policy and --policy-owns-routing reach the rollout service's Config;
// bad values are usage errors naming the flag.
func TestPolicyFlags(t *testing.T) {
	parse := func(args ...string) (*rolloutFlags, *env) {
		t.Helper()
		e := &env{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }, reg: newRegistry(nil)}
		f := &rolloutFlags{}
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		if err := f.register(fs, e); err != nil {
			t.Fatal(err)
		}
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return f, e
	}
	f, e := parse("--policy", "http://a:8000/v1", "--policy", "http://b:8000/v1/", "--policy-owns-routing")
	cfg, err := f.config(e, slog.New(slog.DiscardHandler), nil, "", nil, nil, tracing{})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Engines == nil || strings.Join(cfg.Engines.URLs(), " ") != "http://a:8000/v1 http://b:8000/v1" || !cfg.EnginesOwnRouting {
		t.Fatalf("Config.Engines %v, owns routing %v", cfg.Engines, cfg.EnginesOwnRouting)
	}
	// OSMO_POLICY when no --policy is given.
	envFlags := &rolloutFlags{}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	withEnv := &env{stdout: io.Discard, stderr: io.Discard, reg: newRegistry(nil), getenv: func(k string) string {
		if k == "OSMO_POLICY" {
			return "http://c:8000/v1, dns://vllm:8000/v1"
		}
		return ""
	}}
	if err := envFlags.register(fs, withEnv); err != nil {
		t.Fatal(err)
	}
	if cfg, err := envFlags.config(withEnv, slog.New(slog.DiscardHandler), nil, "", nil, nil, tracing{}); err != nil || cfg.Engines == nil || strings.Join(cfg.Engines.URLs(), " ") != "http://c:8000/v1" {
		t.Fatalf("OSMO_POLICY: engines %v, err %v", cfg.Engines, err)
	}
	f, e = parse()
	if cfg, err := f.config(e, slog.New(slog.DiscardHandler), nil, "", nil, nil, tracing{}); err != nil || cfg.Engines != nil {
		t.Fatalf("without --policy: engines %v, err %v", cfg.Engines, err)
	}
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"--policy", "vllm:8000"}, "--policy"},
		{[]string{"--policy", "dns://vllm/v1"}, "--policy"},
		{[]string{"--policy", "http://a/v1", "--policy-load-factor", "0.9"}, "--policy-load-factor"},
		{[]string{"--policy", "http://a/v1", "--policy-probe-interval", "0s"}, "--policy-probe-interval"},
		{[]string{"--policy", "http://a/v1", "--policy-fail-threshold", "0"}, "--policy-fail-threshold"},
		{[]string{"--policy-owns-routing"}, "--policy-owns-routing"},
		{[]string{"--policy", "http://a/v1", "--policy-retry-budget", "0"}, "--policy-retry-budget"},
		{[]string{"--policy", "http://a/v1", "--policy-min-retries", "0"}, "--policy-min-retries"},
		{[]string{"--policy", "http://a/v1", "--policy-timeout", "-1s"}, "--policy-timeout"},
	} {
		f, e := parse(tc.args...)
		_, err := f.config(e, slog.New(slog.DiscardHandler), nil, "", nil, nil, tracing{})
		var ue usageError
		if !errors.As(err, &ue) || !strings.HasPrefix(err.Error(), tc.flag+":") {
			t.Errorf("%v: error %v, want a usage error naming %s", tc.args, err, tc.flag)
		}
	}
}

// osmo llmproxy --policy spreads samples over the engines and records
// each call's engine; --upstream is one more engine.
func TestLLMProxyPolicy(t *testing.T) {
	type engine struct {
		srv      *httptest.Server
		mu       sync.Mutex
		sessions map[string]bool
	}
	newEngine := func() *engine {
		en := &engine{sessions: map[string]bool{}}
		en.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/health" {
				return
			}
			_, _ = io.Copy(io.Discard, r.Body)
			en.mu.Lock()
			en.sessions[r.Header.Get(llmproxy.HeaderSessionID)] = true
			en.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop"}]}`)
		}))
		t.Cleanup(en.srv.Close)
		return en
	}
	a, b, c := newEngine(), newEngine(), newEngine()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var out logtest.Buffer
	e := &env{stdout: &out, stderr: &out, getenv: func(string) string { return "" }, reg: newRegistry(nil)}
	done := make(chan error, 1)
	go func() {
		done <- commands()["llmproxy"].run(ctx, e, []string{"--addr", "127.0.0.1:0", "--upstream", a.srv.URL + "/v1",
			"--policy", b.srv.URL + "/v1", "--policy", c.srv.URL + "/v1"})
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
			t.Fatalf("llmproxy ended: %v\n%s", err, out.String())
		case <-ctx.Done():
			t.Fatalf("llmproxy did not start:\n%s", out.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	base = strings.Replace(base, "0.0.0.0", "127.0.0.1", 1)
	const samples = 30
	for s := range samples {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set(llmproxy.HeaderRolloutID, "r1")
		req.Header.Set(llmproxy.HeaderSampleID, "s"+string(rune('a'+s)))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	total := 0
	for i, en := range []*engine{a, b, c} {
		en.mu.Lock()
		n := len(en.sessions)
		en.mu.Unlock()
		if n == 0 {
			t.Errorf("engine %d got no sample", i)
		}
		total += n
	}
	if total != samples {
		t.Errorf("%d sessions over the engines, want %d (one per sample, each on one engine)", total, samples)
	}
	resp, err := http.Get(base + "/r/r1/calls")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var listed struct {
		Calls []struct {
			Engine string `json:"engine"`
		} `json:"calls"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&listed); err != nil {
		t.Fatal(err)
	}
	calls := listed.Calls
	if len(calls) != samples || calls[0].Engine == "" {
		t.Fatalf("recorded calls %+v", calls)
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("llmproxy: %v", err)
	}
}
