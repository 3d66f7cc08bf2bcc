package llmproxy_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// storeListing is the JSON of GET /r/{rollout_id}/calls.
type storeListing struct {
	RolloutID string `json:"rollout_id"`
	Calls     []struct {
		RolloutID       string           `json:"rollout_id"`
		SampleID        string           `json:"sample_id"`
		Model           string           `json:"model"`
		RequestedModel  string           `json:"requested_model"`
		RequestMessages []map[string]any `json:"request_messages"`
		ResponseMessage map[string]any   `json:"response_message"`
		Stream          bool             `json:"stream"`
		StatusCode      int              `json:"status_code"`
		Attempts        int              `json:"attempts"`
		Usage           struct {
			TotalTokens int `json:"total_tokens"`
		} `json:"usage"`
	} `json:"calls"`
}

func getListing(t *testing.T, url string) (int, storeListing) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var l storeListing
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, &l); err != nil {
			t.Fatalf("listing is not the expected JSON (messages must be embedded, not strings): %v: %s", err, body)
		}
	}
	return resp.StatusCode, l
}

func TestStoreEndpoint(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(llmproxy.HeaderSampleID) == "streamer" {
			sseHandler("\n", `{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`, `[DONE]`)(w, r)
			return
		}
		okJSON(w, r)
	})
	store := llmproxy.NewStore(100, time.Hour)
	p, err := llmproxy.New(llmproxy.Config{
		Router:   llmproxy.StaticRouter(llmproxy.Route{BaseURL: up.base, Model: "policy-v1"}),
		Recorder: store,
	})
	if err != nil {
		t.Fatal(err)
	}
	// Mounted the way the standalone server mounts it.
	mux := http.NewServeMux()
	mux.Handle("GET /r/{rollout_id}/calls", store)
	mux.Handle("/", p)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	post(t, srv.URL+"/r/roll-a/s/plain/v1/chat/completions", chatBody, nil)
	post(t, srv.URL+"/r/roll-a/s/streamer/v1/chat/completions", streamBody, nil)
	post(t, srv.URL+"/r/roll-b/s/x/v1/chat/completions", chatBody, nil)

	// Recording happens after the answer; wait until both calls are in.
	deadline := time.Now().Add(testTimeout)
	for len(store.Calls("roll-a")) < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	status, l := getListing(t, srv.URL+"/r/roll-a/calls")
	if status != http.StatusOK || l.RolloutID != "roll-a" || len(l.Calls) != 2 {
		t.Fatalf("listing status %d: %+v", status, l)
	}
	c0, c1 := l.Calls[0], l.Calls[1]
	if c0.SampleID != "plain" || c0.Model != "policy-v1" || c0.RequestedModel != "openai/osmosis-rollout" || c0.Stream || c0.StatusCode != 200 || c0.Attempts != 1 || c0.Usage.TotalTokens != 11 {
		t.Errorf("first call = %+v", c0)
	}
	if len(c0.RequestMessages) != 1 || c0.RequestMessages[0]["content"] != "What is 2+2?" || c0.ResponseMessage["content"] != "4" {
		t.Errorf("first call messages = %v -> %v", c0.RequestMessages, c0.ResponseMessage)
	}
	if c1.SampleID != "streamer" || !c1.Stream || c1.ResponseMessage["content"] != "hi" {
		t.Errorf("second call = %+v", c1)
	}

	status, l = getListing(t, srv.URL+"/r/unknown/calls")
	if status != http.StatusOK || len(l.Calls) != 0 {
		t.Errorf("unknown rollout: status %d, %d calls; want 200 and none", status, len(l.Calls))
	}
}

func TestStoreLimits(t *testing.T) {
	t.Run("max calls evicts the oldest", func(t *testing.T) {
		s := llmproxy.NewStore(3, 0)
		for i, id := range []string{"a", "b", "a", "a", "b"} {
			s.RecordCall(context.Background(), &osmo.LLMCall{RolloutID: id, Attempts: i})
		}
		var got []int
		for _, id := range []string{"a", "b"} {
			for _, c := range s.Calls(id) {
				got = append(got, c.Attempts)
			}
		}
		if want := []int{2, 3, 4}; !slices.Equal(got, want) {
			t.Errorf("kept calls %v, want %v", got, want)
		}
	})
	t.Run("ttl forgets old calls", func(t *testing.T) {
		s := llmproxy.NewStore(10, 20*time.Millisecond)
		s.RecordCall(context.Background(), &osmo.LLMCall{RolloutID: "a"})
		if n := len(s.Calls("a")); n != 1 {
			t.Fatalf("fresh call not kept: %d", n)
		}
		deadline := time.Now().Add(testTimeout)
		for len(s.Calls("a")) > 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if n := len(s.Calls("a")); n != 0 {
			t.Errorf("%d calls kept past the ttl", n)
		}
	})
	t.Run("served without a mux pattern", func(t *testing.T) {
		s := llmproxy.NewStore(10, 0)
		s.RecordCall(context.Background(), &osmo.LLMCall{RolloutID: "a/b", RequestMessages: []json.RawMessage{json.RawMessage(`{"role":"user"}`)}})
		srv := httptest.NewServer(s)
		t.Cleanup(srv.Close)
		status, l := getListing(t, srv.URL+"/r/a%2Fb/calls")
		if status != http.StatusOK || len(l.Calls) != 1 || l.Calls[0].RequestMessages[0]["role"] != "user" {
			t.Errorf("status %d listing %+v", status, l)
		}
		if status, _ := getListing(t, srv.URL+"/elsewhere"); status != http.StatusNotFound {
			t.Errorf("other path: status %d, want 404", status)
		}
	})
}
