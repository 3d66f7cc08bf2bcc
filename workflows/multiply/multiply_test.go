package multiply_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/integrations/osmoopenai"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/osmotest"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
	"github.com/osmo-rl/osmo/workflows/multiply"
)

const token = "tok-multiply"

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// runtime routes every sample of a rollout through the proxy at proxyURL.
type runtime struct{ proxyURL, rolloutID string }

func (r runtime) Endpoint(sampleID string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: llmproxy.BaseURLFor(r.proxyURL, r.rolloutID, sampleID), APIKey: token}
}
func (runtime) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (runtime) LogEvent(string, map[string]any)      {}
func (runtime) RecordToolCall(string, time.Duration) {}

// stack is the mock policy behind a real LLM proxy on loopback, keeping the
// request bodies the policy received.
type stack struct {
	proxyURL string
	store    *llmproxy.Store

	mu     sync.Mutex
	bodies []map[string]any
}

func newStack(t *testing.T) *stack {
	t.Helper()
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	s := &stack{store: llmproxy.NewStore(0, 0)}
	mockSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var body map[string]any
		_ = json.Unmarshal(b, &body)
		s.mu.Lock()
		s.bodies = append(s.bodies, body)
		s.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(b))
		mock.ServeHTTP(w, r)
	}))
	t.Cleanup(mockSrv.Close)
	proxy, err := llmproxy.New(llmproxy.Config{
		Router:          llmproxy.StaticRouter(llmproxy.Route{BaseURL: mockSrv.URL + "/v1", Model: "mock-policy", ClientToken: token}),
		Recorder:        s.store,
		Timeout:         10 * time.Second,
		RequireSampleID: true,
	})
	if err != nil {
		t.Fatalf("llmproxy.New: %v", err)
	}
	proxySrv := httptest.NewServer(proxy)
	t.Cleanup(proxySrv.Close)
	s.proxyURL = proxySrv.URL
	return s
}

func (s *stack) upstreamBodies() []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]map[string]any(nil), s.bodies...)
}

// run executes wf for one prompt through the stack.
func (s *stack) run(t *testing.T, wf *osmo.Workflow, rolloutID string, prompt []osmo.Message) (*osmo.Rollout, error) {
	t.Helper()
	r := osmotest.NewRollout(rolloutID, runtime{proxyURL: s.proxyURL, rolloutID: rolloutID})
	err := osmotest.Run(testCtx(t), wf, r, &osmotest.Input{RolloutID: rolloutID, Prompt: prompt})
	return r, err
}

func userPrompt(text string) []osmo.Message {
	return []osmo.Message{{"role": "user", "content": text}}
}

func roles(msgs []osmo.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i], _ = m["role"].(string)
	}
	return out
}

func TestWorkflowSolvesThroughTheProxy(t *testing.T) {
	st := newStack(t)
	r, err := st.run(t, multiply.New(), "rollout-m", userPrompt("What is 6 times 7?"))
	if err != nil {
		t.Fatal(err)
	}
	sources := osmotest.Sources(r)
	if len(sources) != 1 || sources[0].ID != multiply.SampleID {
		t.Fatalf("sources = %v, want one, %q", sources, multiply.SampleID)
	}
	msgs, err := osmotest.Messages(sources[0].Source)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := roles(msgs), []string{"system", "user", "assistant", "tool", "assistant"}; !slices.Equal(got, want) {
		t.Fatalf("roles = %v, want %v\n%v", got, want, msgs)
	}
	if msgs[0]["content"] != multiply.DefaultConfig().Instructions {
		t.Errorf("system message = %v, want the instructions", msgs[0])
	}
	if msgs[3]["content"] != "42" {
		t.Errorf("tool message = %v, want 42", msgs[3])
	}
	if text := osmo.LastAssistantText(msgs); !strings.Contains(text, "42") {
		t.Errorf("final text %q does not contain 42", text)
	}

	calls := st.store.Calls("rollout-m")
	if len(calls) != 2 {
		t.Fatalf("proxy recorded %d calls, want 2", len(calls))
	}
	for i, c := range calls {
		if c.SampleID != multiply.SampleID || c.RequestedModel != osmoopenai.Model || c.StatusCode != http.StatusOK {
			t.Errorf("call %d: sample %q model %q status %d; want %q, %q, 200", i, c.SampleID, c.RequestedModel, c.StatusCode, multiply.SampleID, osmoopenai.Model)
		}
	}
	// The config's sampling settings and the tool reach the policy.
	for i, b := range st.upstreamBodies() {
		tools, _ := b["tools"].([]any)
		if b["temperature"] != 1.0 || b["max_tokens"] != 4096.0 || len(tools) != 1 {
			t.Errorf("request %d: temperature %v max_tokens %v tools %v; want 1, 4096 and the multiply tool", i, b["temperature"], b["max_tokens"], b["tools"])
		}
	}
}

// A config laid over the default changes what is sent: no instructions, no
// max_tokens, another temperature.
func TestWorkflowConfigApplies(t *testing.T) {
	st := newStack(t)
	wf, err := multiply.New().WithConfigJSON([]byte(`{"instructions":"","max_tokens":0,"temperature":0.2,"max_turns":1}`))
	if err != nil {
		t.Fatal(err)
	}
	r, err := st.run(t, wf, "rollout-c", userPrompt("What is 6 times 7?"))
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := osmotest.Messages(osmotest.Sources(r)[0].Source)
	if err != nil {
		t.Fatal(err)
	}
	// One turn: the model's tool call is the last message.
	if got, want := roles(msgs), []string{"user", "assistant"}; !slices.Equal(got, want) {
		t.Errorf("roles = %v, want %v", got, want)
	}
	bodies := st.upstreamBodies()
	if len(bodies) != 1 {
		t.Fatalf("%d model calls, want 1 (max_turns 1)", len(bodies))
	}
	if _, ok := bodies[0]["max_tokens"]; ok || bodies[0]["temperature"] != 0.2 {
		t.Errorf("request: max_tokens %v temperature %v; want none and 0.2", bodies[0]["max_tokens"], bodies[0]["temperature"])
	}
}

func TestWorkflowRejectsBadInput(t *testing.T) {
	tests := []struct {
		name   string
		prompt []osmo.Message
		want   string
	}{
		{"empty prompt", nil, "prompt is empty"},
		{"unknown role", []osmo.Message{{"role": "narrator", "content": "x"}}, `field "role"`},
		{"content of the wrong type", []osmo.Message{{"role": "user", "content": 6}}, `field "content"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := newStack(t)
			r, err := st.run(t, multiply.New(), "rollout-bad", tc.prompt)
			if !errors.Is(err, osmo.ErrInvalidInput) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want osmo.ErrInvalidInput naming %q", err, tc.want)
			}
			if n := len(osmotest.Sources(r)); n != 0 {
				t.Errorf("%d sample sources registered, want none", n)
			}
			if n := len(st.upstreamBodies()); n != 0 {
				t.Errorf("%d model calls, want none", n)
			}
		})
	}
}

func TestNew(t *testing.T) {
	wf := multiply.New()
	if wf.Name() != "multiply" {
		t.Errorf("Name = %q, want multiply", wf.Name())
	}
	cfg, ok := wf.Config().(*multiply.Config)
	if !ok {
		t.Fatalf("Config = %T, want *multiply.Config", wf.Config())
	}
	want := multiply.Config{
		AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "multiply"},
		Instructions:        "Use the multiply tool when arithmetic is required.",
		Temperature:         1.0,
		MaxTokens:           4096,
		MaxTurns:            10,
	}
	if *cfg != want {
		t.Errorf("config = %+v, want %+v", *cfg, want)
	}
	if err := wf.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	tools := wf.Tools()
	if len(tools) != 1 {
		t.Fatalf("Tools = %v, want the multiply tool", tools)
	}
	for _, tool := range (multiply.Workflow{}).Tools() {
		name, err := osmo.ValidateTool(tool)
		if err != nil || name != "multiply" {
			t.Errorf("ValidateTool = %q, %v; want multiply, nil", name, err)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name   string
		change func(c *multiply.Config)
		fields []string // fields named by the error; none for a valid config
	}{
		{"default", func(*multiply.Config) {}, nil},
		{"zeros", func(c *multiply.Config) { c.Temperature, c.MaxTokens, c.MaxTurns = 0, 0, 0 }, nil},
		{"temperature 2", func(c *multiply.Config) { c.Temperature = 2 }, nil},
		{"no name", func(c *multiply.Config) { c.Name = " " }, []string{"name"}},
		{"temperature too high", func(c *multiply.Config) { c.Temperature = 2.01 }, []string{"temperature"}},
		{"negative temperature", func(c *multiply.Config) { c.Temperature = -0.1 }, []string{"temperature"}},
		{"NaN temperature", func(c *multiply.Config) { c.Temperature = math.NaN() }, []string{"temperature"}},
		{"negative max_tokens", func(c *multiply.Config) { c.MaxTokens = -1 }, []string{"max_tokens"}},
		{"negative max_turns", func(c *multiply.Config) { c.MaxTurns = -1 }, []string{"max_turns"}},
		{"several", func(c *multiply.Config) { c.MaxTurns, c.MaxTokens = -1, -1 }, []string{"max_tokens", "max_turns"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := multiply.DefaultConfig()
			tc.change(c)
			err := c.Validate()
			if len(tc.fields) == 0 {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			joined, ok := err.(interface{ Unwrap() []error })
			if !ok {
				t.Fatalf("err = %v, want the joined field errors", err)
			}
			var got []string
			for _, e := range joined.Unwrap() {
				var ce *multiply.ConfigError
				if !errors.As(e, &ce) {
					t.Fatalf("error %v is not a *ConfigError", e)
				}
				got = append(got, ce.Field)
			}
			if !slices.Equal(got, tc.fields) {
				t.Errorf("fields = %v, want %v (%v)", got, tc.fields, err)
			}
		})
	}
}

// A bad config file is refused before the workflow runs.
func TestWithConfigJSONValidates(t *testing.T) {
	if _, err := multiply.New().WithConfigJSON([]byte(`{"temperature":3}`)); err == nil || !strings.Contains(err.Error(), "temperature") {
		t.Fatalf("err = %v, want one naming temperature", err)
	}
}

func TestMultiplyTool(t *testing.T) {
	tests := []struct {
		args string
		want string // result, or a substring of the error
		err  bool
	}{
		{`{"a":6,"b":7}`, "42", false},
		{`{"a":-3,"b":4}`, "-12", false},
		{`{"a":6.0,"b":7e0}`, "42", false},
		{`{"a":9223372036854775807,"b":2}`, "18446744073709551614", false},
		{`{"a":6.5,"b":1}`, `"a" must be an integer`, true},
		{`{"a":"6","b":7}`, `"a" must be an integer`, true},
		{`{"a":null,"b":7}`, `"a" must be an integer`, true},
		{`{"a":6,"b":1e300}`, `"b" must be an integer`, true},
		{`{"a":6}`, `missing argument "b"`, true},
		{`{"a":6,"b":7,"c":8}`, `unknown argument "c"`, true},
		{`[6,7]`, "JSON object", true},
	}
	call := multiply.Tool().Call
	for _, tc := range tests {
		t.Run(tc.args, func(t *testing.T) {
			got, err := call(testCtx(t), json.RawMessage(tc.args))
			switch {
			case tc.err && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("call(%s) = %q, %v; want an error containing %q", tc.args, got, err, tc.want)
			case !tc.err && (err != nil || got != tc.want):
				t.Errorf("call(%s) = %q, %v; want %q", tc.args, got, err, tc.want)
			}
		})
	}
}
