package osmoeino_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cloudwego/eino/schema"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoeino"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/osmotest"
)

func TestNewChatModelOutsideRollout(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cm, err := osmoeino.NewChatModel(ctx, "agent")
	if !errors.Is(err, osmo.ErrNoRollout) {
		t.Fatalf("NewChatModel outside a rollout = %v, %v; want an error wrapping osmo.ErrNoRollout", cm, err)
	}
}

func TestNewChatModelDuplicateSample(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	ctx, r := inRollout(t, upstreamRuntime(u))
	if _, err := osmoeino.NewChatModel(ctx, "agent"); err != nil {
		t.Fatalf("first NewChatModel: %v", err)
	}
	_, err := osmoeino.NewChatModel(ctx, "agent")
	if !errors.Is(err, osmo.ErrDuplicateSample) {
		t.Fatalf("second NewChatModel under the same id = %v, want osmo.ErrDuplicateSample", err)
	}
	if n := len(osmotest.Sources(r)); n != 1 {
		t.Errorf("rollout has %d sources, want 1", n)
	}
	// Another name is another sample.
	if _, err := osmoeino.NewChatModel(ctx, "other-agent"); err != nil {
		t.Fatalf("NewChatModel under a new id: %v", err)
	}
	if n := len(osmotest.Sources(r)); n != 2 {
		t.Errorf("rollout has %d sources, want 2", n)
	}
}

func TestNewChatModelEmptySampleIDGetsOne(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	rt := upstreamRuntime(u)
	ctx, r := inRollout(t, rt)
	if _, err := osmoeino.NewChatModel(ctx, ""); err != nil {
		t.Fatal(err)
	}
	srcs := osmotest.Sources(r)
	if len(srcs) != 1 || !strings.HasPrefix(srcs[0].ID, "sample-") {
		t.Fatalf("sources %+v, want one under a generated sample-… id", srcs)
	}
	if asked := rt.askedFor(); len(asked) != 1 || asked[0] != srcs[0].ID {
		t.Errorf("endpoint asked for %q, want the registered id %q", asked, srcs[0].ID)
	}
}

func TestNewChatModelRefuses(t *testing.T) {
	nan := float32(math.NaN())
	for _, tc := range []struct {
		name     string
		sampleID string
		baseURL  string
		opts     []osmoeino.Option
		field    string // OptionError.Field, when the error is one
		want     string // in the error
	}{
		{name: "bad sample id", sampleID: "has space", baseURL: "http://127.0.0.1:1/v1", want: "sample id"},
		{name: "no endpoint", sampleID: "a", baseURL: "", want: "empty"},
		{name: "relative endpoint", sampleID: "a", baseURL: "/v1", want: "not an absolute http(s) URL"},
		{name: "other scheme", sampleID: "a", baseURL: "ftp://127.0.0.1/v1", want: "not an absolute http(s) URL"},
		{name: "temperature too high", sampleID: "a", baseURL: "http://127.0.0.1:1/v1", opts: []osmoeino.Option{osmoeino.WithTemperature(2.5)}, field: "temperature"},
		{name: "temperature NaN", sampleID: "a", baseURL: "http://127.0.0.1:1/v1", opts: []osmoeino.Option{osmoeino.WithTemperature(nan)}, field: "temperature"},
		{name: "top_p zero", sampleID: "a", baseURL: "http://127.0.0.1:1/v1", opts: []osmoeino.Option{osmoeino.WithTopP(0)}, field: "top_p"},
		{name: "max tokens zero", sampleID: "a", baseURL: "http://127.0.0.1:1/v1", opts: []osmoeino.Option{osmoeino.WithMaxTokens(0)}, field: "max_tokens"},
		{name: "empty stop", sampleID: "a", baseURL: "http://127.0.0.1:1/v1", opts: []osmoeino.Option{osmoeino.WithStop("###", "")}, field: "stop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := &runtime{endpoint: func(string) osmo.Endpoint { return osmo.Endpoint{BaseURL: tc.baseURL, APIKey: "k"} }}
			ctx, r := inRollout(t, rt)
			_, err := osmoeino.NewChatModel(ctx, tc.sampleID, tc.opts...)
			if err == nil {
				t.Fatal("NewChatModel succeeded, want an error")
			}
			if tc.field != "" {
				var oe *osmoeino.OptionError
				if !errors.As(err, &oe) || oe.Field != tc.field {
					t.Fatalf("error %v, want an *OptionError for %q", err, tc.field)
				}
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not contain %q", err, tc.want)
			}
			if n := len(osmotest.Sources(r)); n != 0 {
				t.Errorf("a refused model registered %d sources", n)
			}
		})
	}
}

// TestGenerateBindsAndRecords runs a tool turn and a final turn through the
// tool-bound model and checks what reached the policy and what was recorded.
func TestGenerateBindsAndRecords(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	rt := &runtime{endpoint: func(sampleID string) osmo.Endpoint {
		return osmo.Endpoint{
			BaseURL: u.url + "/v1",
			APIKey:  testToken,
			Headers: map[string]string{"X-Trace-Hint": "from-runtime"},
		}
	}}
	ctx, r := inRollout(t, rt)
	cm, err := osmoeino.NewChatModel(ctx, "calc", osmoeino.WithTemperature(0.5), osmoeino.WithSeed(7))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := osmotest.Messages(osmotest.Sources(r)[0].Source); err == nil {
		t.Error("SampleMessages before any call succeeded, want an error saying the model was never called")
	}
	tm, err := cm.WithTools([]*schema.ToolInfo{multiplyInfo()})
	if err != nil {
		t.Fatal(err)
	}

	in := []*schema.Message{schema.SystemMessage("Use the tools."), schema.UserMessage(task)}
	call, err := tm.Generate(ctx, in)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	if len(call.ToolCalls) != 1 || call.ToolCalls[0].Function.Name != "multiply" {
		t.Fatalf("first reply %+v, want one multiply call", call)
	}
	id := call.ToolCalls[0].ID
	want := jsonMessages(t, `[
		{"role":"system","content":"Use the tools."},
		{"role":"user","content":"What is 6 times 7?"},
		{"role":"assistant","content":null,"tool_calls":[{"id":"`+id+`","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}
	]`)
	if got := sampleOf(t, r); !reflect.DeepEqual(got, want) {
		t.Fatalf("sample after the tool turn:\n got %s\nwant %s", mustJSON(got), mustJSON(want))
	}

	in = append(in, call, schema.ToolMessage("42", id, schema.WithToolName("multiply")))
	final, err := tm.Generate(ctx, in)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	want = append(want,
		osmo.Message{"role": "tool", "content": "42", "tool_call_id": id},
		osmo.Message{"role": "assistant", "content": final.Content},
	)
	if got := sampleOf(t, r); !reflect.DeepEqual(got, want) {
		t.Fatalf("sample after the final turn:\n got %s\nwant %s", mustJSON(got), mustJSON(want))
	}
	if !strings.Contains(final.Content, "42") {
		t.Errorf("final answer %q does not contain 42", final.Content)
	}

	reqs := u.requests()
	if len(reqs) != 2 {
		t.Fatalf("upstream got %d requests, want 2", len(reqs))
	}
	for i, req := range reqs {
		for k, v := range map[string]string{
			"X-Rollout-Id":  testRolloutID,
			"X-Sample-Id":   "calc",
			"X-Trace-Hint":  "from-runtime",
			"Authorization": "Bearer " + testToken,
		} {
			if got := req.header.Get(k); got != v {
				t.Errorf("request %d: header %s = %q, want %q", i, k, got, v)
			}
		}
		if req.body["model"] != osmo.PlaceholderModel || req.body["temperature"] != 0.5 || req.body["seed"] != float64(7) {
			t.Errorf("request %d: model %v temperature %v seed %v, want %q, 0.5, 7", i, req.body["model"], req.body["temperature"], req.body["seed"], osmo.PlaceholderModel)
		}
		if tools, _ := req.body["tools"].([]any); len(tools) != 1 {
			t.Errorf("request %d: %d tools, want the bound multiply tool", i, len(tools))
		}
	}
}

// TestGenerateRuntimeHeadersWin checks that the runtime's headers replace
// the ones derived from the rollout.
func TestGenerateRuntimeHeadersWin(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	rt := &runtime{endpoint: func(string) osmo.Endpoint {
		return osmo.Endpoint{BaseURL: u.url + "/v1", APIKey: testToken, Headers: map[string]string{"x-sample-id": "routed-as"}}
	}}
	ctx, _ := inRollout(t, rt)
	cm, err := osmoeino.NewChatModel(ctx, "calc")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cm.Generate(ctx, []*schema.Message{schema.UserMessage(task)}); err != nil {
		t.Fatal(err)
	}
	reqs := u.requests()
	if len(reqs) != 1 || reqs[0].header.Get("X-Sample-Id") != "routed-as" || len(reqs[0].header.Values("X-Sample-Id")) != 1 {
		t.Fatalf("X-Sample-Id %q, want only the runtime's %q", reqs[0].header.Values("X-Sample-Id"), "routed-as")
	}
}

// TestGenerateUsesEndpointClient checks that the endpoint's client carries
// the calls (the runtime's tracing lives there), headers added on top.
func TestGenerateUsesEndpointClient(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	var through []string
	client := &http.Client{Transport: roundTripFunc(func(req *http.Request) (*http.Response, error) {
		through = append(through, req.Header.Get("X-Sample-Id"))
		return http.DefaultTransport.RoundTrip(req)
	})}
	rt := &runtime{endpoint: func(string) osmo.Endpoint {
		return osmo.Endpoint{BaseURL: u.url + "/v1", APIKey: testToken, HTTPClient: client}
	}}
	ctx, _ := inRollout(t, rt)
	cm, err := osmoeino.NewChatModel(ctx, "calc")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cm.Generate(ctx, []*schema.Message{schema.UserMessage(task)}); err != nil {
		t.Fatal(err)
	}
	if len(through) != 1 || through[0] != "calc" {
		t.Fatalf("endpoint client saw sample ids %q, want one call for calc", through)
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestGenerateFailureKeepsRequest(t *testing.T) {
	u := newUpstream(t, mockllm.Options{FailMode: mockllm.Fail500, FailEvery: 1})
	ctx, r := inRollout(t, upstreamRuntime(u))
	cm, err := osmoeino.NewChatModel(ctx, "calc")
	if err != nil {
		t.Fatal(err)
	}
	_, err = cm.Generate(ctx, []*schema.Message{schema.UserMessage(task)})
	if err == nil || !strings.Contains(err.Error(), "500") || !strings.Contains(err.Error(), `sample "calc"`) {
		t.Fatalf("Generate against a failing upstream = %v, want an error naming the sample and the 500", err)
	}
	want := jsonMessages(t, `[{"role":"user","content":"What is 6 times 7?"}]`)
	if got := sampleOf(t, r); !reflect.DeepEqual(got, want) {
		t.Errorf("sample %s, want the request alone %s", mustJSON(got), mustJSON(want))
	}
}

func TestGenerateRefusesUnrecordableRequest(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	ctx, _ := inRollout(t, upstreamRuntime(u))
	cm, err := osmoeino.NewChatModel(ctx, "calc")
	if err != nil {
		t.Fatal(err)
	}
	_, err = cm.Generate(ctx, []*schema.Message{schema.UserMessage(task), nil})
	var me *osmoeino.MessageError
	if !errors.As(err, &me) || me.Index != 1 {
		t.Fatalf("Generate with a nil message = %v, want a *MessageError for message 1", err)
	}
	if n := len(u.requests()); n != 0 {
		t.Errorf("upstream got %d requests, want none", n)
	}
}

func TestStreamRecordsConcatenatedReply(t *testing.T) {
	for _, tc := range []struct {
		name  string
		tools bool
		// check asserts the recorded reply.
		check func(t *testing.T, reply osmo.Message)
	}{
		{name: "text", check: func(t *testing.T, reply osmo.Message) {
			if reply["content"] != "The answer is 42.\n#### 42" {
				t.Errorf("recorded reply content %q, want the whole answer", reply["content"])
			}
		}},
		{name: "tool call", tools: true, check: func(t *testing.T, reply osmo.Message) {
			calls, _ := reply["tool_calls"].([]any)
			if len(calls) != 1 {
				t.Fatalf("recorded reply %s, want one tool call", mustJSON(reply))
			}
			fn, _ := calls[0].(map[string]any)["function"].(map[string]any)
			if fn["name"] != "multiply" || fn["arguments"] != `{"a":6,"b":7}` {
				t.Errorf("recorded call %s, want multiply with the arguments joined from every chunk", mustJSON(calls[0]))
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := newUpstream(t, mockllm.Options{})
			ctx, r := inRollout(t, upstreamRuntime(u))
			cm, err := osmoeino.NewChatModel(ctx, "calc")
			if err != nil {
				t.Fatal(err)
			}
			if tc.tools {
				if cm, err = cm.WithTools([]*schema.ToolInfo{multiplyInfo()}); err != nil {
					t.Fatal(err)
				}
			}
			sr, err := cm.Stream(ctx, []*schema.Message{schema.UserMessage(task)})
			if err != nil {
				t.Fatalf("Stream: %v", err)
			}
			defer sr.Close()
			var chunks []*schema.Message
			for {
				c, err := sr.Recv()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatalf("Recv: %v", err)
				}
				chunks = append(chunks, c)
			}
			if len(chunks) < 2 {
				t.Fatalf("got %d chunks, want a reply in several", len(chunks))
			}
			msgs := sampleOf(t, r)
			if len(msgs) != 2 || msgs[0]["content"] != task || msgs[1]["role"] != "assistant" {
				t.Fatalf("sample %s, want the request and the reply", mustJSON(msgs))
			}
			tc.check(t, msgs[1])
			if reqs := u.requests(); len(reqs) != 1 || reqs[0].body["stream"] != true {
				t.Errorf("upstream requests %d, want one streamed", len(reqs))
			}
		})
	}
}

// TestStreamClosedEarlyRecordsNoReply: a reply nobody read to its end is not
// a reply the agent acted on.
func TestStreamClosedEarlyRecordsNoReply(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	ctx, r := inRollout(t, upstreamRuntime(u))
	cm, err := osmoeino.NewChatModel(ctx, "calc")
	if err != nil {
		t.Fatal(err)
	}
	sr, err := cm.Stream(ctx, []*schema.Message{schema.UserMessage(task)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sr.Recv(); err != nil {
		t.Fatal(err)
	}
	sr.Close()
	// The answer streams in more chunks than the relay can read ahead, so
	// it cannot have reached the end before the close.
	msgs := sampleOf(t, r)
	if len(msgs) != 1 || msgs[0]["role"] != "user" {
		t.Fatalf("sample %s, want the request alone", mustJSON(msgs))
	}
}

func TestStreamUpstreamFailure(t *testing.T) {
	u := newUpstream(t, mockllm.Options{FailMode: mockllm.Fail503, FailEvery: 1})
	ctx, r := inRollout(t, upstreamRuntime(u))
	cm, err := osmoeino.NewChatModel(ctx, "calc")
	if err != nil {
		t.Fatal(err)
	}
	sr, err := cm.Stream(ctx, []*schema.Message{schema.UserMessage(task)})
	if err == nil {
		// Some clients report the status on the first Recv instead.
		defer sr.Close()
		_, err = sr.Recv()
	}
	if err == nil || errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "503") {
		t.Fatalf("stream against a failing upstream: %v, want an error naming the 503", err)
	}
	if msgs := sampleOf(t, r); len(msgs) != 1 {
		t.Errorf("sample %s, want the request alone", mustJSON(msgs))
	}
}

func TestWithMaxTokensIsSent(t *testing.T) {
	u := newUpstream(t, mockllm.Options{})
	ctx, _ := inRollout(t, upstreamRuntime(u))
	cm, err := osmoeino.NewChatModel(ctx, "calc", osmoeino.WithMaxTokens(3), osmoeino.WithTopP(0.9), osmoeino.WithStop("####"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := cm.Generate(ctx, []*schema.Message{schema.UserMessage(task)})
	if err != nil {
		t.Fatal(err)
	}
	if out.ResponseMeta == nil || out.ResponseMeta.FinishReason != "length" {
		t.Errorf("reply %+v, want one cut at max_tokens (finish_reason length)", out)
	}
	body := u.requests()[0].body
	stop, _ := json.Marshal(body["stop"])
	if body["max_tokens"] != float64(3) || body["top_p"] != 0.9 || string(stop) != `["####"]` {
		t.Errorf("request max_tokens %v top_p %v stop %s, want 3, 0.9, [\"####\"]", body["max_tokens"], body["top_p"], stop)
	}
}
