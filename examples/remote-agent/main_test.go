package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

// policy plays the model, in process: first it asks for the tool, then it
// answers with what the tool said.
type policy struct{ turn int }

func (p *policy) Endpoint(string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: "http://policy.test/v1", HTTPClient: &http.Client{Transport: p}}
}
func (*policy) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (*policy) LogEvent(string, map[string]any)      {}
func (*policy) RecordToolCall(string, time.Duration) {}

func (p *policy) RoundTrip(req *http.Request) (*http.Response, error) {
	var body struct {
		Messages []osmo.Message `json:"messages"`
	}
	if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
		return nil, err
	}
	p.turn++
	msg := osmo.Message{"role": "assistant", "tool_calls": []any{
		map[string]any{"id": "c1", "type": "function", "function": map[string]any{"name": "count_words", "arguments": `{"text":"the quick brown fox"}`}},
	}}
	if p.turn > 1 {
		last := body.Messages[len(body.Messages)-1]
		msg = osmo.Message{"role": "assistant", "content": "There are " + last["content"].(string) + " words."}
	}
	b, err := json.Marshal(map[string]any{"choices": []any{map[string]any{"message": msg, "finish_reason": "stop"}}})
	if err != nil {
		return nil, err
	}
	return &http.Response{StatusCode: http.StatusOK, Body: io.NopCloser(bytes.NewReader(b)), Request: req}, nil
}

func TestWordCountLoopAndReward(t *testing.T) {
	req := &osmo.RolloutRequest{MaxTurns: 5, Messages: []osmo.Message{{"role": "user", "content": "How many words in 'the quick brown fox'?"}}}
	res, err := WordCount{}.Run(context.Background(), osmotest.NewRolloutContext(osmotest.NewRollout("r1", &policy{}), "word-count", req, nil))
	if err != nil {
		t.Fatal(err)
	}
	answer := osmo.LastAssistantText(res.FinalMessages)
	if answer != "There are 4 words." {
		t.Fatalf("answer %q", answer)
	}
	for truth, want := range map[string]float64{"4": 1, "5": 0} {
		if r, err := ExactNumber(answer, truth, nil); err != nil || r != want {
			t.Errorf("ExactNumber(%q, %q) = %v, %v; want %v", answer, truth, r, err, want)
		}
	}
	if _, err := ExactNumber(answer, "four", nil); err == nil {
		t.Error("a non-numeric ground truth must be an error")
	}
}
