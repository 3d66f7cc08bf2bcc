//go:build unix

package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestV03Controller drives `osmo serve` as today's Osmosis controller (SDK
// v0.3) does, with one shared secret and with two separate ones, against
// an AgentWorkflow and an agent loop: every rollout succeeds, its reward
// arrives in the grader callback's sample, the LLM calls bear the LLM key
// and the callbacks the callback key.
func TestV03Controller(t *testing.T) {
	mockAddr := startMockPolicy(t)

	for _, wf := range []struct{ workflow, prompt, right, wrong string }{
		{"multiply", "What is 6 times 7?", "42", "41"},
		{"calculator", "What is 6 * 7?", "42", "41"},
	} {
		t.Run(wf.workflow, func(t *testing.T) {
			srv, addrs := startListening(t, "serve", nil, "serve", "--workflow", wf.workflow, "--api-key", serverKey,
				"-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
			base := addrs["http"]
			waitHTTP(t, srv, base+"/health")

			for _, keys := range []struct{ name, llm string }{{"one secret", ""}, {"two secrets", "K-llm"}} {
				t.Run(keys.name, func(t *testing.T) {
					ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
						PolicyURL: "http://" + mockAddr + "/v1", CallbackKey: "K-callbacks", LLMKey: keys.llm,
						CallbackTimeout: 60 * time.Second, Logger: quietLog(),
					})
					if err != nil {
						t.Fatal(err)
					}
					serveUntilEnd(t, ctl.Serve)

					const n = 8
					var wg sync.WaitGroup
					results := make([]controller.V03Result, n)
					errs := make([]error, n)
					for i := range n {
						wg.Add(1)
						go func() {
							defer wg.Done()
							label := wf.right
							if i%2 == 1 {
								label = wf.wrong
							}
							rctx, rcancel := context.WithTimeout(context.Background(), 90*time.Second)
							defer rcancel()
							results[i], errs[i] = ctl.Run(rctx, base, serverKey, controller.V03RunRequest{
								RolloutID: fmt.Sprintf("v03-%s-%d", strings.ReplaceAll(keys.name, " ", "-"), i),
								Messages:  []map[string]any{{"role": "user", "content": wf.prompt}},
								Label:     &label,
								Metadata:  map[string]any{"row": i},
							})
						}()
					}
					wg.Wait()
					for i, res := range results {
						want := 1.0
						if i%2 == 1 {
							want = 0
						}
						if errs[i] != nil || res.Source != controller.SourceGrader || res.Status != "success" || res.Sample == nil ||
							res.Sample.Reward == nil || *res.Sample.Reward != want || len(res.Sample.Messages) < 3 {
							t.Errorf("rollout %d: %+v %v (refused callbacks %v)\nserver output:\n%s", i, res, errs[i], ctl.Rejected(), srv.Output())
							continue
						}
						if c := res.Completion; c == nil || c.Status != "success" || c.Header.Get("Authorization") != "Bearer K-callbacks" {
							t.Errorf("rollout %d: completion %+v", i, c)
						}
						if g := ctl.GraderCallbacks(res.RolloutID); len(g) != 1 || len(ctl.Completions(res.RolloutID)) != 1 {
							t.Errorf("rollout %d: %d grader callbacks and %d completions, want 1 each", i, len(g), len(ctl.Completions(res.RolloutID)))
						}
					}
					llmKey := keys.llm
					if llmKey == "" {
						llmKey = "K-callbacks"
					}
					chats := ctl.Chats()
					if len(chats) < n {
						t.Errorf("%d LLM calls reached the bridge, want at least %d", len(chats), n)
					}
					for _, c := range chats {
						if got := c.Header.Get("Authorization"); got != "Bearer "+llmKey {
							t.Errorf("LLM call bore %q, want the LLM key", got)
						}
					}
				})
			}
		})
	}
}
