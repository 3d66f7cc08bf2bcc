package einoagent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	einoagent "github.com/osmo-rl/osmo/examples/eino-agent"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/osmotest"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

const (
	// upstreamModel is what the proxy sends instead of the placeholder.
	upstreamModel = "mock-policy"
	task          = "What is 6 times 7?"
	runTimeout    = 30 * time.Second
)

// ids are the rollout and sample ids a request carried in its headers.
type ids struct{ rollout, sample string }

// headerLog keeps the id headers of every request through a handler.
type headerLog struct {
	mu   sync.Mutex
	seen []ids
}

func (l *headerLog) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.seen = append(l.seen, ids{r.Header.Get(llmproxy.HeaderRolloutID), r.Header.Get(llmproxy.HeaderSampleID)})
		l.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

// of returns the ids of the requests for rollout (all requests: "").
func (l *headerLog) of(rollout string) []ids {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []ids
	for _, s := range l.seen {
		if rollout == "" || s.rollout == rollout {
			out = append(out, s)
		}
	}
	return out
}

// stack is the mock policy behind a real LLM proxy, both on loopback, each
// keeping the id headers it received.
type stack struct {
	mockURL  string
	proxyURL string
	routes   *llmproxy.RouteTable
	store    *llmproxy.Store
	upstream *headerLog // what the policy received from the proxy
	ingress  *headerLog // what the proxy received from the agent
}

func newStack(t *testing.T) *stack {
	t.Helper()
	mock, err := mockllm.New(mockllm.Options{})
	if err != nil {
		t.Fatalf("mockllm.New: %v", err)
	}
	s := &stack{routes: llmproxy.NewRouteTable(), store: llmproxy.NewStore(0, 0), upstream: &headerLog{}, ingress: &headerLog{}}
	mockSrv := httptest.NewServer(s.upstream.wrap(mock))
	t.Cleanup(mockSrv.Close)
	s.mockURL = mockSrv.URL

	proxy, err := llmproxy.New(llmproxy.Config{
		Router:          s.routes,
		Recorder:        s.store,
		Timeout:         runTimeout,
		RequireSampleID: true,
	})
	if err != nil {
		t.Fatalf("llmproxy.New: %v", err)
	}
	proxySrv := httptest.NewServer(s.ingress.wrap(proxy))
	t.Cleanup(proxySrv.Close)
	s.proxyURL = proxySrv.URL
	return s
}

// bind routes rollout to the mock and returns the token its agent must present.
func (s *stack) bind(rollout string) string {
	token := "tok-" + rollout
	s.routes.Set(rollout, llmproxy.Route{BaseURL: s.mockURL + "/v1", Model: upstreamModel, ClientToken: token})
	return token
}

// runtime is the rollout service's part, as a test plays it: every sample's
// calls go to the proxy under the rollout and the sample. It leaves
// Endpoint.Headers empty so the headers seen are the integration's own.
type runtime struct {
	proxyURL, rolloutID, token string
}

func (rt *runtime) Endpoint(sampleID string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: llmproxy.BaseURLFor(rt.proxyURL, rt.rolloutID, sampleID), APIKey: rt.token}
}

func (rt *runtime) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (rt *runtime) LogEvent(string, map[string]any)      {}
func (rt *runtime) RecordToolCall(string, time.Duration) {}

func prompt(text string) *osmotest.Input {
	return &osmotest.Input{Prompt: []osmo.Message{{"role": "user", "content": text}}}
}

// run executes wf for one rollout against s and returns the rollout.
func run(t *testing.T, wf *osmo.Workflow, s *stack, rolloutID, token string, in *osmotest.Input) (*osmo.Rollout, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()
	r := osmotest.NewRollout(rolloutID, &runtime{proxyURL: s.proxyURL, rolloutID: rolloutID, token: token})
	in.RolloutID = rolloutID
	return r, osmotest.Run(ctx, wf, r, in)
}

func TestWorkflowSolvesThroughTheProxy(t *testing.T) {
	s := newStack(t)
	const rolloutID = "rollout-eino-1"
	r, err := run(t, einoagent.New(), s, rolloutID, s.bind(rolloutID), prompt(task))
	if err != nil {
		t.Fatalf("workflow: %v", err)
	}

	srcs := osmotest.Sources(r)
	if len(srcs) != 1 || srcs[0].ID != einoagent.AgentName {
		t.Fatalf("sources %+v, want exactly one, %q", srcs, einoagent.AgentName)
	}
	msgs, err := osmotest.Messages(srcs[0].Source)
	if err != nil {
		t.Fatalf("SampleMessages: %v", err)
	}
	checkConversation(t, msgs)

	calls := s.store.Calls(rolloutID)
	if len(calls) < 2 {
		t.Fatalf("proxy recorded %d calls for %s, want a tool turn and a final turn", len(calls), rolloutID)
	}
	for i, c := range calls {
		if c.SampleID != einoagent.AgentName || c.RequestedModel != osmo.PlaceholderModel || c.Model != upstreamModel || c.StatusCode != http.StatusOK || c.Error != "" {
			t.Errorf("call %d: sample %q requested %q sent %q status %d err %q; want sample %q, %q rewritten to %q, 200",
				i, c.SampleID, c.RequestedModel, c.Model, c.StatusCode, c.Error, einoagent.AgentName, osmo.PlaceholderModel, upstreamModel)
		}
	}
	last := calls[len(calls)-1]
	if !strings.Contains(string(last.ResponseMessage), "#### 42") {
		t.Errorf("last recorded response %s, want the final answer", last.ResponseMessage)
	}
	if n := len(last.RequestMessages); n != len(msgs)-1 {
		t.Errorf("last call sent %d messages, want the sample's %d before the reply", n, len(msgs)-1)
	}

	// The agent sent the ids itself, and the policy got them from the proxy.
	want := ids{rolloutID, einoagent.AgentName}
	for name, log := range map[string]*headerLog{"proxy": s.ingress, "policy": s.upstream} {
		seen := log.of("")
		if len(seen) != len(calls) {
			t.Errorf("%s received %d requests, want %d", name, len(seen), len(calls))
		}
		for i, got := range seen {
			if got != want {
				t.Errorf("%s request %d carried X-Rollout-Id %q X-Sample-Id %q, want %q %q", name, i, got.rollout, got.sample, want.rollout, want.sample)
			}
		}
	}
}

// checkConversation asserts the sample is the whole solve as OpenAI chat
// messages: the task, a multiply call, its result and the answer.
func checkConversation(t *testing.T, msgs []osmo.Message) {
	t.Helper()
	dump, err := json.Marshal(msgs)
	if err != nil {
		t.Fatalf("sample does not encode as JSON: %v", err)
	}
	// Plain JSON objects: decoding the encoding gives the same values back.
	var decoded []osmo.Message
	if err := json.Unmarshal(dump, &decoded); err != nil || !reflect.DeepEqual(decoded, msgs) {
		t.Fatalf("sample is not plain JSON objects (%v):\n%s", err, dump)
	}
	if len(msgs) != 4 {
		t.Fatalf("sample has %d messages, want user, assistant call, tool result, answer:\n%s", len(msgs), dump)
	}
	if msgs[0]["role"] != "user" || msgs[0]["content"] != task {
		t.Errorf("message 0 %v, want the user's task", msgs[0])
	}

	call := msgs[1]
	calls, _ := call["tool_calls"].([]any)
	if call["role"] != "assistant" || len(calls) != 1 {
		t.Fatalf("message 1 %v, want an assistant turn with one tool call", call)
	}
	tc, _ := calls[0].(map[string]any)
	fn, _ := tc["function"].(map[string]any)
	id, _ := tc["id"].(string)
	argsJSON, _ := fn["arguments"].(string)
	var args struct{ A, B float64 }
	if err := json.Unmarshal([]byte(argsJSON), &args); err != nil || tc["type"] != "function" || id == "" || fn["name"] != "multiply" || args.A*args.B != 42 {
		t.Errorf("tool call %v, want a function call of multiply on 6 and 7 with an id", tc)
	}

	if res := msgs[2]; res["role"] != "tool" || res["tool_call_id"] != id || res["content"] != "42" {
		t.Errorf("message 2 %v, want the tool result 42 for call %q", res, id)
	}

	answer := msgs[3]
	text, _ := answer["content"].(string)
	if answer["role"] != "assistant" || answer["tool_calls"] != nil || !strings.Contains(text, "42") {
		t.Errorf("message 3 %v, want a final assistant text containing 42", answer)
	}
	if got := osmo.LastAssistantText(msgs); got != text {
		t.Errorf("LastAssistantText = %q, want %q", got, text)
	}
}

// TestWorkflowServesConcurrentRollouts runs rollouts at once on one
// workflow: each gets its own agent, sample and calls.
func TestWorkflowServesConcurrentRollouts(t *testing.T) {
	s := newStack(t)
	wf := einoagent.New()
	tasks := []struct {
		q, want string
	}{{"What is 6 times 7?", "42"}, {"What is 3 times 5?", "15"}, {"What is 12 times 12?", "144"}, {"What is 9 times 8?", "72"}}
	var wg sync.WaitGroup
	errs := make([]error, len(tasks))
	rollouts := make([]*osmo.Rollout, len(tasks))
	for i, tk := range tasks {
		id := fmt.Sprintf("rollout-%d", i)
		token := s.bind(id)
		wg.Go(func() {
			rollouts[i], errs[i] = run(t, wf, s, id, token, prompt(tk.q))
		})
	}
	wg.Wait()
	for i, tk := range tasks {
		id := fmt.Sprintf("rollout-%d", i)
		if errs[i] != nil {
			t.Errorf("%s: %v", id, errs[i])
			continue
		}
		srcs := osmotest.Sources(rollouts[i])
		if len(srcs) != 1 {
			t.Errorf("%s: %d sources, want 1", id, len(srcs))
			continue
		}
		msgs, err := osmotest.Messages(srcs[0].Source)
		if err != nil {
			t.Errorf("%s: SampleMessages: %v", id, err)
			continue
		}
		if msgs[0]["content"] != tk.q || !strings.Contains(osmo.LastAssistantText(msgs), tk.want) {
			t.Errorf("%s: sample asks %v and answers %q, want %q answered with %s", id, msgs[0]["content"], osmo.LastAssistantText(msgs), tk.q, tk.want)
		}
		if n := len(s.store.Calls(id)); n != 2 {
			t.Errorf("%s: proxy recorded %d calls, want 2", id, n)
		}
		for _, got := range s.ingress.of(id) {
			if got.sample != einoagent.AgentName {
				t.Errorf("%s: a call carried sample id %q, want %q", id, got.sample, einoagent.AgentName)
			}
		}
	}
}

func TestWorkflowFails(t *testing.T) {
	for _, tc := range []struct {
		name  string
		in    *osmotest.Input
		token string // overrides the rollout's token when set
		// check asserts the error.
		check func(t *testing.T, err error)
		// calls is how many requests may reach the proxy.
		calls int
	}{
		{
			name: "bad prompt", in: &osmotest.Input{Prompt: []osmo.Message{{"role": "robot", "content": task}}},
			check: func(t *testing.T, err error) {
				if !errors.Is(err, osmo.ErrInvalidInput) || !strings.Contains(err.Error(), "role") {
					t.Errorf("error %v, want osmo.ErrInvalidInput naming the role", err)
				}
			},
		},
		{
			name: "empty prompt", in: &osmotest.Input{},
			check: func(t *testing.T, err error) {
				if !errors.Is(err, osmo.ErrInvalidInput) {
					t.Errorf("error %v, want osmo.ErrInvalidInput", err)
				}
			},
		},
		{
			name: "token refused", in: prompt(task), token: "not-the-rollout-token", calls: 1,
			check: func(t *testing.T, err error) {
				if err == nil || !strings.Contains(err.Error(), "401") {
					t.Errorf("error %v, want one naming the proxy's 401", err)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStack(t)
			const rolloutID = "rollout-bad"
			token := s.bind(rolloutID)
			if tc.token != "" {
				token = tc.token
			}
			_, err := run(t, einoagent.New(), s, rolloutID, token, tc.in)
			if err == nil {
				t.Fatal("workflow succeeded, want an error")
			}
			tc.check(t, err)
			if n := len(s.ingress.of("")); n != tc.calls {
				t.Errorf("proxy received %d requests, want %d", n, tc.calls)
			}
			if n := len(s.upstream.of("")); n != 0 {
				t.Errorf("policy received %d requests, want none", n)
			}
		})
	}
}

func TestWorkflowDeclaration(t *testing.T) {
	wf := einoagent.New()
	if wf.Name() != einoagent.Name {
		t.Errorf("Name = %q, want %q", wf.Name(), einoagent.Name)
	}
	if err := wf.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	tools := wf.Tools()
	if len(tools) != 1 {
		t.Fatalf("Tools = %v, want the multiply schema", tools)
	}
	name, err := osmo.ValidateTool(tools[0])
	params, _ := tools[0]["function"].(map[string]any)["parameters"].(map[string]any)
	props, _ := params["properties"].(map[string]any)
	if err != nil || name != "multiply" || props["a"] == nil || props["b"] == nil {
		t.Errorf("tool %v (%v), want multiply(a, b)", tools[0], err)
	}

	for _, tc := range []struct {
		config string
		ok     bool
	}{
		{config: `{"temperature": 0.2, "max_steps": 6}`, ok: true},
		{config: `{"max_steps": 0}`, ok: true},
		{config: `{"temperature": 2.5}`},
		{config: `{"temperature": -1}`},
		{config: `{"max_steps": -1}`},
	} {
		t.Run(tc.config, func(t *testing.T) {
			next, err := wf.WithConfigJSON([]byte(tc.config))
			if (err == nil) != tc.ok {
				t.Fatalf("WithConfigJSON = %v, want ok %v", err, tc.ok)
			}
			if tc.ok && next.Name() != einoagent.Name {
				t.Errorf("rebound workflow is named %q, want %q", next.Name(), einoagent.Name)
			}
		})
	}
}
