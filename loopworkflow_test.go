package osmo_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/host"
	"github.com/osmo-rl/osmo/osmotest"
)

// policyRuntime is a osmo.Runtime whose endpoints reach an httptest
// policy; it counts the tool calls recorded.
type policyRuntime struct {
	url   string
	mu    sync.Mutex
	tools map[string]int
}

func (p *policyRuntime) Endpoint(sampleID string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: p.url + "/s/" + sampleID + "/v1", APIKey: "rollout-token", Headers: map[string]string{"x-sample-id": sampleID}}
}
func (p *policyRuntime) Logger() *slog.Logger            { return slog.New(slog.DiscardHandler) }
func (p *policyRuntime) LogEvent(string, map[string]any) {}
func (p *policyRuntime) RecordToolCall(sampleID string, _ time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tools == nil {
		p.tools = map[string]int{}
	}
	p.tools[sampleID]++
}

// scriptedLoop calls the policy once, records a tool call and ends as its
// mode says.
type scriptedLoop struct {
	name  string
	mode  string
	tools []osmo.Tool
}

func (l scriptedLoop) Name() string { return l.name }
func (l scriptedLoop) GetTools(req *osmo.RolloutRequest) ([]osmo.Tool, error) {
	if l.mode == "tools-fail" {
		return nil, errors.New("tool registry down")
	}
	return l.tools, nil
}
func (l scriptedLoop) Run(ctx context.Context, rc *osmo.RolloutContext) (*osmo.RolloutResult, error) {
	res, err := rc.Chat(ctx, rc.Request.Messages, nil)
	if err != nil {
		return nil, err
	}
	rc.RecordToolCall(time.Millisecond)
	msgs := append(osmo.CloneMessages(rc.Request.Messages), res.Message)
	switch l.mode {
	case "error":
		return rc.Error("the tool server is down"), nil
	case "raise":
		return nil, errors.New("database exploded")
	case "panic":
		panic("nil map write")
	case "nil":
		return nil, nil
	case "recorded":
		return rc.Complete(nil, "stop", nil), nil
	}
	r := rc.Complete(msgs, "max_turns", osmo.Float(0.5))
	r.ExtraFields = map[string]any{"turns": 1}
	return r, nil
}

// startPolicy answers every chat completion with "42" and keeps what it
// was sent.
func startPolicy(t *testing.T) (*httptest.Server, func() []map[string]any) {
	t.Helper()
	var mu sync.Mutex
	var got []map[string]any
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		data, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(data, &body)
		body["_auth"] = r.Header.Get("Authorization")
		body["_path"] = r.URL.Path
		mu.Lock()
		got = append(got, body)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","choices":[{"message":{"role":"assistant","content":"42"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}))
	t.Cleanup(srv.Close)
	return srv, func() []map[string]any {
		mu.Lock()
		defer mu.Unlock()
		return append([]map[string]any(nil), got...)
	}
}

func TestAgentLoopWorkflow(t *testing.T) {
	prompt := []osmo.Message{{"role": "user", "content": "What is 6 * 7?"}}
	tools := []osmo.Tool{{"type": "function", "function": map[string]any{"name": "multiply"}}}

	t.Run("one sample with the loop's result", func(t *testing.T) {
		policy, sent := startPolicy(t)
		wf, err := osmo.AgentLoopWorkflow(scriptedLoop{name: "calc", tools: tools})
		if err != nil {
			t.Fatal(err)
		}
		if wf.Name() != "calc" || osmo.Hosting().LoopSampleID(wf) != "calc" {
			t.Fatalf("name %q, sample id %q", wf.Name(), osmo.Hosting().LoopSampleID(wf))
		}
		rt := &policyRuntime{url: policy.URL}
		r := osmotest.NewRollout("r1", rt)
		req := &osmo.RolloutRequest{RolloutID: "r1", Messages: prompt, CompletionParams: map[string]any{"temperature": 0.5}}
		if err := host.Run(t.Context(), wf, r, &host.Input{RolloutID: "r1", Prompt: prompt, Request: req, Tools: tools}); err != nil {
			t.Fatal(err)
		}
		srcs := osmotest.Sources(r)
		if len(srcs) != 1 || srcs[0].ID != "calc" {
			t.Fatalf("sources %v, want one named calc", srcs)
		}
		msgs, err := osmotest.Messages(srcs[0].Source)
		if err != nil || len(msgs) != 2 || msgs[1]["content"] != "42" {
			t.Errorf("messages %v (%v), want the prompt and the answer", msgs, err)
		}
		res := srcs[0].Source.(osmo.SampleResult)
		if res.SampleFinishReason() != "max_turns" || res.SampleAgentReward() == nil || *res.SampleAgentReward() != 0.5 {
			t.Errorf("finish %q reward %v, want the loop's", res.SampleFinishReason(), res.SampleAgentReward())
		}
		if x := srcs[0].Source.(osmo.SampleExtras).SampleExtraFields(); x["turns"] != 1 {
			t.Errorf("extra fields %v", x)
		}
		calls := sent()
		if len(calls) != 1 {
			t.Fatalf("%d policy calls, want 1", len(calls))
		}
		c := calls[0]
		if c["_path"] != "/s/calc/v1/chat/completions" || c["_auth"] != "Bearer rollout-token" || c["model"] != osmo.PlaceholderModel {
			t.Errorf("call went to %v with %v, model %v", c["_path"], c["_auth"], c["model"])
		}
		// The SDK's client asks for log probabilities unless told otherwise,
		// and the tools and completion_params come along.
		if c["logprobs"] != true || c["temperature"] != 0.5 || c["tools"] == nil {
			t.Errorf("call body %v: want logprobs true, temperature 0.5 and the tools", c)
		}
		if rt.tools["calc"] != 1 {
			t.Errorf("tool calls recorded %v, want one for calc", rt.tools)
		}
	})

	t.Run("completion_params may turn logprobs off", func(t *testing.T) {
		policy, sent := startPolicy(t)
		wf, _ := osmo.AgentLoopWorkflow(scriptedLoop{name: "calc"})
		r := osmotest.NewRollout("r2", &policyRuntime{url: policy.URL})
		req := &osmo.RolloutRequest{Messages: prompt, CompletionParams: map[string]any{"logprobs": false}}
		if err := host.Run(t.Context(), wf, r, &host.Input{Prompt: prompt, Request: req}); err != nil {
			t.Fatal(err)
		}
		if c := sent()[0]; c["logprobs"] != false {
			t.Errorf("logprobs %v, want the request's false", c["logprobs"])
		}
	})

	t.Run("without a G1 request the loop gets one made of the input", func(t *testing.T) {
		policy, sent := startPolicy(t)
		wf, _ := osmo.AgentLoopWorkflow(scriptedLoop{name: "calc", tools: tools})
		r := osmotest.NewRollout("r3", &policyRuntime{url: policy.URL})
		if err := host.Run(t.Context(), wf, r, &host.Input{RolloutID: "r3", Prompt: prompt, Metadata: map[string]any{"k": "v"}}); err != nil {
			t.Fatal(err)
		}
		if c := sent()[0]; c["tools"] == nil {
			t.Errorf("call %v: want the tools GetTools returned", c)
		}
		if _, err := osmo.Hosting().ToolsFor(wf, &osmo.RolloutRequest{}); err != nil {
			t.Error(err)
		}
	})

	for _, tc := range []struct{ mode, want string }{
		{"error", "the tool server is down"},
		{"raise", "database exploded"},
		{"panic", "agent loop panicked: nil map write"},
		{"nil", "agent loop returned neither a result nor an error"},
		{"tools-fail", "get_tools failed: tool registry down"},
	} {
		t.Run("fails: "+tc.mode, func(t *testing.T) {
			policy, _ := startPolicy(t)
			wf, _ := osmo.AgentLoopWorkflow(scriptedLoop{name: "calc", mode: tc.mode})
			r := osmotest.NewRollout("r4", &policyRuntime{url: policy.URL})
			in := &host.Input{Prompt: prompt}
			if tc.mode != "tools-fail" {
				in.Request = &osmo.RolloutRequest{Messages: prompt}
			}
			err := host.Run(t.Context(), wf, r, in)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
			if tc.mode == "tools-fail" {
				return
			}
			// The sample is there, for what the proxy recorded.
			srcs := osmotest.Sources(r)
			if len(srcs) != 1 {
				t.Fatalf("sources %v, want the loop's one", srcs)
			}
			if msgs, err := osmotest.Messages(srcs[0].Source); err != nil || msgs != nil {
				t.Errorf("a failed loop's sample has messages %v (%v), want none of its own", msgs, err)
			}
			if f := srcs[0].Source.(osmo.SampleResult).SampleFinishReason(); f != "error" {
				t.Errorf("finish reason %q, want error", f)
			}
		})
	}

	t.Run("no messages of its own: the recorded conversation stands", func(t *testing.T) {
		policy, _ := startPolicy(t)
		wf, _ := osmo.AgentLoopWorkflow(scriptedLoop{name: "calc", mode: "recorded"})
		r := osmotest.NewRollout("r5", &policyRuntime{url: policy.URL})
		if err := host.Run(t.Context(), wf, r, &host.Input{Prompt: prompt, Request: &osmo.RolloutRequest{Messages: prompt}}); err != nil {
			t.Fatal(err)
		}
		if msgs, _ := osmotest.Messages(osmotest.Sources(r)[0].Source); msgs != nil {
			t.Errorf("messages %v, want nil (the proxy's record)", msgs)
		}
	})

	t.Run("a name that is no sample id", func(t *testing.T) {
		wf, err := osmo.AgentLoopWorkflow(scriptedLoop{name: "my loop"})
		if err != nil || osmo.Hosting().LoopSampleID(wf) != "agent" {
			t.Fatalf("%v, sample id %q; want the fallback agent", err, osmo.Hosting().LoopSampleID(wf))
		}
		if _, err := osmo.AgentLoopWorkflow(nil); err == nil {
			t.Error("a nil loop was accepted")
		}
		if _, err := osmo.AgentLoopWorkflow(scriptedLoop{}); err == nil {
			t.Error("a loop without a name was accepted")
		}
	})

	t.Run("an upstream error names its status", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"maximum context length exceeded","type":"invalid_request_error"}}`)
		}))
		t.Cleanup(srv.Close)
		wf, _ := osmo.AgentLoopWorkflow(scriptedLoop{name: "calc"})
		r := osmotest.NewRollout("r6", &policyRuntime{url: srv.URL})
		err := host.Run(t.Context(), wf, r, &host.Input{Prompt: prompt, Request: &osmo.RolloutRequest{Messages: prompt}})
		if err == nil || !strings.Contains(err.Error(), "HTTP 400: maximum context length exceeded") {
			t.Fatalf("err = %v", err)
		}
	})
}
