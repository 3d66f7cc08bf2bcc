package osmoopenai_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
	"github.com/osmo-rl/osmo/osmotest"
)

// multiplyTool multiplies two JSON numbers.
func multiplyTool() osmoopenai.Tool {
	return osmoopenai.Tool{
		Name:        "multiply",
		Description: "Multiply two numbers.",
		Parameters: map[string]any{
			"type":       "object",
			"properties": map[string]any{"a": map[string]any{"type": "number"}, "b": map[string]any{"type": "number"}},
			"required":   []any{"a", "b"},
		},
		Call: func(_ context.Context, args json.RawMessage) (string, error) {
			var in struct{ A, B float64 }
			if err := json.Unmarshal(args, &in); err != nil {
				return "", err
			}
			return fmt.Sprint(in.A * in.B), nil
		},
	}
}

// A session's calls go through the real proxy under its rollout and sample,
// and the session holds the conversation exactly as it went on the wire.
func TestSessionRoundTripThroughProxy(t *testing.T) {
	st := newStack(t)
	ctx, r := st.rollout(t, "rollout-1")

	s, err := osmoopenai.NewSession(ctx, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	s.AddItems(openai.SystemMessage("Use the multiply tool."))
	resp, err := osmoopenai.Run(ctx, s, openai.ChatCompletionNewParams{
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(task)},
	}, []osmoopenai.Tool{multiplyTool()}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Choices[0].Message.Content; !strings.Contains(got, "42") {
		t.Errorf("final completion %q does not contain 42", got)
	}

	items := s.Items()
	if got, want := roles(items), []string{"system", "user", "assistant", "tool", "assistant"}; !slices.Equal(got, want) {
		t.Fatalf("item roles = %v, want %v\nitems: %v", got, want, items)
	}
	calls, _ := items[2]["tool_calls"].([]any)
	if len(calls) != 1 {
		t.Fatalf("assistant item 2 has tool_calls %v, want one call", items[2]["tool_calls"])
	}
	fn, _ := calls[0].(map[string]any)["function"].(map[string]any)
	callID, _ := calls[0].(map[string]any)["id"].(string)
	if fn["name"] != "multiply" || callID == "" {
		t.Errorf("tool call = %v, want a multiply call with an id", calls[0])
	}
	if items[3]["tool_call_id"] != callID || items[3]["content"] != "42" {
		t.Errorf("tool item = %v, want content 42 answering %q", items[3], callID)
	}
	if text := osmo.LastAssistantText(items); !strings.Contains(text, "42") {
		t.Errorf("last assistant text %q does not contain 42", text)
	}

	// The sample is the session, registered under its name.
	sources := osmotest.Sources(r)
	if len(sources) != 1 || sources[0].ID != "agent-1" || sources[0].Source != osmo.SampleSource(s) {
		t.Fatalf("rollout sources = %v, want the session as agent-1", sources)
	}
	sample, err := osmotest.Messages(sources[0].Source)
	if err != nil || !reflect.DeepEqual(sample, items) {
		t.Errorf("SampleMessages = %v, %v; want the session items", sample, err)
	}
	// The JSON returned is a copy: changing it changes nothing in the
	// session.
	raw, err := s.SampleMessages()
	if err != nil || len(raw) != len(items) {
		t.Fatalf("SampleMessages = %d messages, %v; want %d", len(raw), err, len(items))
	}
	clear(raw[0])
	if again, _ := s.SampleMessages(); !json.Valid(again[0]) {
		t.Error("changing what SampleMessages returned changed the session")
	}

	// The proxy recorded both calls under the rollout and the sample, with
	// the placeholder model as sent, and the requests held the items.
	recorded := st.store.Calls("rollout-1")
	if len(recorded) != 2 {
		t.Fatalf("proxy recorded %d calls, want 2", len(recorded))
	}
	for i, c := range recorded {
		if c.RolloutID != "rollout-1" || c.SampleID != "agent-1" || c.RequestedModel != osmoopenai.Model || c.Model != upstreamModel || c.StatusCode != 200 {
			t.Errorf("call %d: rollout %q sample %q requested %q sent %q status %d; want rollout-1, agent-1, %q rewritten to %q, 200",
				i, c.RolloutID, c.SampleID, c.RequestedModel, c.Model, c.StatusCode, osmoopenai.Model, upstreamModel)
		}
	}
	if got := messagesOf(t, recorded[0]); !reflect.DeepEqual(got, items[:2]) {
		t.Errorf("first request messages = %v, want items[:2] = %v", got, items[:2])
	}
	if got := messagesOf(t, recorded[1]); !reflect.DeepEqual(got, items[:4]) {
		t.Errorf("second request messages = %v, want items[:4] = %v", got, items[:4])
	}

	// The client sent the ids itself, and they reached the upstream.
	for name, log := range map[string]*headerLog{"proxy": &st.atProxy, "upstream": &st.upstream} {
		hs := log.all()
		if len(hs) != 2 {
			t.Fatalf("%s saw %d requests, want 2", name, len(hs))
		}
		for i, h := range hs {
			if h.Get("X-Rollout-Id") != "rollout-1" || h.Get("X-Sample-Id") != "agent-1" {
				t.Errorf("%s request %d: X-Rollout-Id %q X-Sample-Id %q, want rollout-1 and agent-1", name, i, h.Get("X-Rollout-Id"), h.Get("X-Sample-Id"))
			}
		}
	}
}

func TestNewSessionNames(t *testing.T) {
	ctx, r := rolloutCtx(t, "r1", func(string) string { return "http://127.0.0.1:1/v1" })
	a, err := osmoopenai.NewSession(ctx, "agent")
	if err != nil {
		t.Fatal(err)
	}
	if a.ID() != "agent" {
		t.Errorf("ID = %q, want agent", a.ID())
	}
	if _, err := osmoopenai.NewSession(ctx, "agent"); !errors.Is(err, osmo.ErrDuplicateSample) {
		t.Errorf("second session named agent: err = %v, want osmo.ErrDuplicateSample", err)
	}
	anon, err := osmoopenai.NewSession(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(anon.ID(), "sample-") || osmo.ValidSampleID(anon.ID()) != nil {
		t.Errorf("unnamed session id = %q, want a generated sample id", anon.ID())
	}
	if _, err := osmoopenai.NewSession(ctx, "bad/name"); err == nil {
		t.Error("session named bad/name: no error")
	}
	var ids []string
	for _, src := range osmotest.Sources(r) {
		ids = append(ids, src.ID)
	}
	if want := []string{"agent", anon.ID()}; !slices.Equal(ids, want) {
		t.Errorf("registered %v, want %v (failed sessions register nothing)", ids, want)
	}
}

// Complete adds params.Messages first, defaults the model, sends every
// other param, and keeps an empty reply as an explicit empty content.
func TestComplete(t *testing.T) {
	up := newScripted(t, completion(`{"role":"assistant","content":"","refusal":null}`))
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	s.AddItems(openai.SystemMessage("sys"))
	if _, err := s.Complete(ctx, openai.ChatCompletionNewParams{
		Messages:    []openai.ChatCompletionMessageParamUnion{openai.UserMessage("one")},
		Temperature: openai.Float(0.5),
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Complete(ctx, openai.ChatCompletionNewParams{
		Model:    "explicit-model",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("two")},
	}); err != nil {
		t.Fatal(err)
	}
	bodies := up.requestBodies()
	if len(bodies) != 2 {
		t.Fatalf("upstream got %d requests, want 2", len(bodies))
	}
	if bodies[0]["model"] != osmoopenai.Model || bodies[0]["temperature"] != 0.5 || bodies[1]["model"] != "explicit-model" {
		t.Errorf("models %v, %v and temperature %v; want %q, explicit-model and 0.5", bodies[0]["model"], bodies[1]["model"], bodies[0]["temperature"], osmoopenai.Model)
	}
	want := []osmo.Message{
		{"role": "system", "content": "sys"},
		{"role": "user", "content": "one"},
		{"role": "assistant", "content": ""},
		{"role": "user", "content": "two"},
		{"role": "assistant", "content": ""},
	}
	if got := s.Items(); !reflect.DeepEqual(got, want) {
		t.Errorf("items = %v, want %v", got, want)
	}
	sent, _ := json.Marshal(bodies[1]["messages"])
	if got := mustJSON(t, sent); !reflect.DeepEqual(got, want[:4]) {
		t.Errorf("second request messages = %v, want %v", got, want[:4])
	}
}

func TestCompleteFailures(t *testing.T) {
	tests := []struct {
		name string
		// prepare fills the session; nil leaves it empty.
		prepare  func(s *osmoopenai.Session)
		reply    string
		want     string
		requests int
	}{
		{name: "empty session", want: "no messages to send", requests: 0},
		{
			name: "unencodable item",
			prepare: func(s *osmoopenai.Session) {
				s.AddItems(openai.UserMessage("ok"), openai.ChatCompletionMessageParamUnion{})
			},
			want:     "item 1",
			requests: 0,
		},
		{
			name:     "no choices",
			prepare:  func(s *osmoopenai.Session) { s.AddItems(openai.UserMessage("ok")) },
			reply:    `{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[]}`,
			want:     "no choices",
			requests: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			reply := tc.reply
			if reply == "" {
				reply = completion(`{"role":"assistant","content":"x"}`)
			}
			up := newScripted(t, reply)
			ctx, _ := rolloutCtx(t, "r1", func(string) string { return up.URL })
			s, err := osmoopenai.NewSession(ctx, "s")
			if err != nil {
				t.Fatal(err)
			}
			if tc.prepare != nil {
				tc.prepare(s)
			}
			_, err = s.Complete(ctx, openai.ChatCompletionNewParams{})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), `session "s"`) {
				t.Fatalf("err = %v, want one naming session \"s\" and %q", err, tc.want)
			}
			if n := len(up.requestBodies()); n != tc.requests {
				t.Errorf("upstream got %d requests, want %d", n, tc.requests)
			}
		})
	}
}

// An item that could not be recorded fails the sample rather than
// presenting a conversation with a hole in it.
func TestSampleMessagesReportsLostItem(t *testing.T) {
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return "http://127.0.0.1:1/v1" })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	s.AddItems(openai.UserMessage("a"), openai.ChatCompletionMessageParamUnion{}, openai.UserMessage("b"))
	if msgs, err := osmotest.Messages(s); err == nil || !strings.Contains(err.Error(), "item 1") {
		t.Fatalf("SampleMessages = %v, %v; want an error naming item 1", msgs, err)
	}
	if got := roles(s.Items()); !slices.Equal(got, []string{"user", "user"}) {
		t.Errorf("items = %v, want the two valid ones", got)
	}
}

// Items hands out copies: changing them does not change the session.
func TestItemsAreCopies(t *testing.T) {
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return "http://127.0.0.1:1/v1" })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	s.AddItems(openai.UserMessage("original"))
	s.Items()[0]["content"] = "changed"
	if got := s.Items()[0]["content"]; got != "original" {
		t.Errorf("content = %v after changing a copy, want original", got)
	}
}

func TestSessionConcurrentUse(t *testing.T) {
	ctx, _ := rolloutCtx(t, "r1", func(string) string { return "http://127.0.0.1:1/v1" })
	s, err := osmoopenai.NewSession(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	const workers, each = 8, 50
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				s.AddItems(openai.UserMessage(fmt.Sprintf("%d-%d", w, i)))
				_ = s.Items()
			}
		}()
	}
	wg.Wait()
	msgs, err := osmotest.Messages(s)
	if err != nil || len(msgs) != workers*each {
		t.Fatalf("SampleMessages: %d messages, %v; want %d", len(msgs), err, workers*each)
	}
}

// messagesOf decodes a recorded call's request messages.
func messagesOf(t *testing.T, c *osmo.LLMCall) []osmo.Message {
	t.Helper()
	b, err := json.Marshal(c.RequestMessages)
	if err != nil {
		t.Fatal(err)
	}
	return mustJSON(t, b)
}
