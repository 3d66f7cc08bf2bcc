package osmoopenai_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
	"github.com/osmo-rl/osmo/osmotest"
)

// scriptedTransport answers each request with the next of replies (the
// last repeats), without a connection: what a call costs the client alone.
type scriptedTransport struct {
	replies []string
	n       int
}

func (t *scriptedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, req.Body)
	_ = req.Body.Close()
	body := t.replies[min(t.n, len(t.replies)-1)]
	t.n++
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body)), Request: req}, nil
}

// BenchmarkRunText is one rollout of the multiply workflow's shape: a
// session, a system message and a prompt, a tool call and the answer.
func BenchmarkRunText(b *testing.B) {
	calls := completion(`{"role":"assistant","content":null,"tool_calls":[{"id":"call-0","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}`)
	answer := completion(`{"role":"assistant","content":"6 times 7 is 42."}`)
	tools := []osmoopenai.Tool{multiplyTool()}
	b.ReportAllocs()
	for b.Loop() {
		client := &http.Client{Transport: &scriptedTransport{replies: []string{calls, answer}}}
		r := osmotest.NewRollout("r1", runtime{endpoint: func(string) osmo.Endpoint {
			return osmo.Endpoint{BaseURL: "http://policy/v1", APIKey: token, HTTPClient: client}
		}})
		ctx := osmotest.ContextWithRollout(context.Background(), r)
		s, err := osmoopenai.NewSession(ctx, "multiply-agent")
		if err != nil {
			b.Fatal(err)
		}
		s.AddItems(openai.SystemMessage("Use the multiply tool when arithmetic is required."), openai.UserMessage(task))
		text, err := osmoopenai.RunText(ctx, s, openai.ChatCompletionNewParams{Temperature: openai.Float(1), MaxTokens: openai.Int(4096)}, tools, 10)
		if err != nil || text != "6 times 7 is 42." {
			b.Fatalf("RunText = %q, %v", text, err)
		}
	}
}
