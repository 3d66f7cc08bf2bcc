package mockllm_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/osmo-rl/osmo/internal/mockllm"
)

// benchmarkChat measures one chat completion through the handler, without
// the network, so the mock's own cost is visible next to a proxy's.
func benchmarkChat(b *testing.B, stream bool) {
	s, err := mockllm.New(mockllm.Options{})
	if err != nil {
		b.Fatal(err)
	}
	body, _ := json.Marshal(map[string]any{
		"model": "openai/osmosis-rollout", "stream": stream, "logprobs": true, "return_token_ids": true,
		"messages": []any{
			map[string]any{"role": "system", "content": "You are a calculator."},
			map[string]any{"role": "user", "content": "What is (17 + 4) * 23 + 9?"},
		},
		"tools": tools("add", "multiply"),
	})
	b.ReportAllocs()
	for b.Loop() {
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
		w := httptest.NewRecorder()
		s.ServeHTTP(w, req)
		if w.Code != http.StatusOK {
			b.Fatalf("status %d", w.Code)
		}
		_, _ = io.Copy(io.Discard, w.Body)
	}
}

func BenchmarkChatJSON(b *testing.B)   { benchmarkChat(b, false) }
func BenchmarkChatStream(b *testing.B) { benchmarkChat(b, true) }
