package llmproxy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// A proxy in front of a policy endpoint: the agent of rollout "r-7" gets a
// base URL that carries its ids, asks for the placeholder model, and the
// policy sees the real model and the ids as headers.
func ExampleNew() {
	policy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Model string `json:"model"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		fmt.Printf("policy got model %s for rollout %s, sample %s\n", req.Model, r.Header.Get("X-Rollout-Id"), r.Header.Get("X-Sample-Id"))
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`)
	}))
	defer policy.Close()

	calls := make(chan *osmo.LLMCall, 1)
	routes := llmproxy.NewRouteTable()
	routes.Set("r-7", llmproxy.Route{BaseURL: policy.URL + "/v1", Model: "qwen3-8b"})
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:   routes,
		Recorder: llmproxy.RecorderFunc(func(_ context.Context, c *osmo.LLMCall) { calls <- c }),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	srv := httptest.NewServer(proxy)
	defer srv.Close()

	baseURL := llmproxy.BaseURLFor(srv.URL, "r-7", "agent-0")
	resp, err := http.Post(baseURL+"/chat/completions", "application/json",
		strings.NewReader(`{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"2+2?"}]}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.Status, len(body) > 0)
	c := <-calls // recorded once the client has its answer
	fmt.Printf("recorded %s -> %s: %s, %d tokens\n", c.RequestedModel, c.Model, c.ResponseMessage, c.Usage.TotalTokens)
	// Output:
	// policy got model qwen3-8b for rollout r-7, sample agent-0
	// 200 OK true
	// recorded openai/osmosis-rollout -> qwen3-8b: {"role":"assistant","content":"4"}, 10 tokens
}
