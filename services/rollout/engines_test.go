package rollout_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
	"github.com/osmo-rl/osmo/services/rollout"
)

// mockEngines starts a mock policy per pause API given (mockllm.PauseAPI*,
// "" for vLLM's) and returns them with their base URLs.
func mockEngines(t *testing.T, pauseAPIs ...string) ([]*mockllm.Server, []string) {
	t.Helper()
	var (
		mocks []*mockllm.Server
		urls  []string
	)
	for _, api := range pauseAPIs {
		m, err := mockllm.New(mockllm.Options{Logger: quietLogger(), PauseAPI: api})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(m)
		t.Cleanup(srv.Close)
		mocks, urls = append(mocks, m), append(urls, srv.URL+"/v1")
	}
	return mocks, urls
}

// With policy engines, a rollout whose trainer names no policy URL calls
// the engines, and the record names each call's engine; a rollout that
// names one calls it, unless the engines own the routing.
func TestRolloutsOverPolicyEngines(t *testing.T) {
	_, engineURLs := mockEngines(t, "", "")
	for _, owns := range []bool{false, true} {
		engines, err := llmproxy.NewEngines(llmproxy.EnginesConfig{URLs: engineURLs})
		if err != nil {
			t.Fatal(err)
		}
		h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
			c.Engines, c.EnginesOwnRouting = engines, owns
		}})
		noURL := h.startReq(t, "no-url")
		noURL.ChatCompletionsUrl = ""
		h.start(t, noURL)
		h.start(t, h.startReq(t, "wire-url"))
		for id, onEngines := range map[string]bool{"no-url": true, "wire-url": owns} {
			r := h.waitDone(t, id)
			if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || len(r.GetSamples()) != 1 {
				t.Fatalf("owns %v, %s: rollout %v", owns, id, r)
			}
			calls := r.GetSamples()[0].GetLlmCalls()
			if len(calls) == 0 {
				t.Fatalf("owns %v, %s: no calls", owns, id)
			}
			for i, c := range calls {
				switch {
				case onEngines && (c.GetEngine() == "" || len(c.GetUpstreamAttempts()) != 1 || c.GetUpstreamAttempts()[0].GetEngine() != c.GetEngine()):
					t.Errorf("owns %v, %s: call %d: engine %q, attempts %v", owns, id, i, c.GetEngine(), c.GetUpstreamAttempts())
				case onEngines && c.GetEngine() != calls[0].GetEngine():
					t.Errorf("owns %v, %s: call %d on %q, the sample's first on %q", owns, id, i, c.GetEngine(), calls[0].GetEngine())
				case !onEngines && (c.GetEngine() != "" || len(c.GetUpstreamAttempts()) != 0):
					t.Errorf("owns %v, %s: call %d went to engine %q, want the trainer's URL", owns, id, i, c.GetEngine())
				}
			}
		}
	}
	// Without engines the policy URL is still required.
	h := newHarness(t, harnessOpts{})
	req := h.startReq(t, "no-url")
	req.ChatCompletionsUrl = ""
	_, err := h.client.StartRollout(context.Background(), req)
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("no chat_completions_url, no engines: %v, want InvalidArgument", err)
	}
}

// A rollout that ended gives its samples' engine slots back at once: the
// engines' load does not wait for the linger after its last call.
func TestEndedRolloutLeavesNoLoad(t *testing.T) {
	_, urls := mockEngines(t, "")
	engines, err := llmproxy.NewEngines(llmproxy.EnginesConfig{URLs: urls, Linger: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.Engines, c.EnginesOwnRouting = engines, true
	}})
	h.start(t, h.startReq(t, "r1"))
	r := h.waitDone(t, "r1")
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || len(r.GetSamples()[0].GetLlmCalls()) == 0 {
		t.Fatalf("rollout %v", r)
	}
	if n := engines.Load(urls[0]); n != 0 {
		t.Fatalf("the engine's load is %d after the rollout ended, want 0", n)
	}
}

// A pause is not forwarded to an engine out of the ring (dead, here): it
// could not take it and gets no calls, and the gate holds the calls of
// every engine anyway. The pause and the resume answer once the engines
// up took them.
func TestPauseSkipsEnginesOutOfTheRing(t *testing.T) {
	up := newPauseEngine(t)
	dead := httptest.NewServer(nil)
	deadURL := dead.URL + "/v1"
	dead.Close()
	engines, err := llmproxy.NewEngines(llmproxy.EnginesConfig{URLs: []string{up.url, deadURL}, ProbeInterval: 20 * time.Millisecond, ProbeTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Engines = engines }})
	waitFor(t, "the dead engine to leave the ring", func() bool { return !engines.Up(deadURL) })
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "keep"}); err != nil {
		t.Fatalf("PausePolicy with an engine out of the ring: %v", err)
	}
	if _, err := h.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: 1}); err != nil {
		t.Fatalf("ResumePolicy: %v", err)
	}
	if got, want := up.calls(), []string{"POST /pause?mode=keep", "POST /resume"}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("the engine up got %q, want %q", got, want)
	}
}

// With policy engines that do not own the routing, a pause goes to the
// engines in the ring and to the policy servers trainers named for their
// rollouts, which serve calls too.
func TestPauseReachesTrainerNamedPolicies(t *testing.T) {
	mocks, urls := mockEngines(t, "", "")
	engines, err := llmproxy.NewEngines(llmproxy.EnginesConfig{URLs: urls[:1]})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Engines = engines }})
	req := h.startReq(t, "trainer-url")
	req.ChatCompletionsUrl = urls[1]
	h.start(t, req)
	if r := h.waitDone(t, "trainer-url"); r.GetState() != rolloutv1.State_STATE_SUCCEEDED {
		t.Fatalf("rollout %v", r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: "keep"}); err != nil {
		t.Fatalf("PausePolicy: %v", err)
	}
	for i, m := range mocks {
		if !m.Paused() {
			t.Errorf("policy %d (%s) was not paused", i, urls[i])
		}
	}
	if _, err := h.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: 1}); err != nil {
		t.Fatalf("ResumePolicy: %v", err)
	}
	for i, m := range mocks {
		if m.Paused() {
			t.Errorf("policy %d (%s) is still paused", i, urls[i])
		}
	}
}

// A pause goes to each engine through its own endpoints, vLLM's or
// SGLang's, and GET /v1/policy says which each has.
func TestPauseReachesVLLMAndSGLangEngines(t *testing.T) {
	mocks, urls := mockEngines(t, mockllm.PauseAPIVLLM, mockllm.PauseAPISGLang)
	engines, err := llmproxy.NewEngines(llmproxy.EnginesConfig{URLs: urls})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, harnessOpts{cfg: func(c *rollout.Config) { c.Engines, c.EnginesOwnRouting = engines, true }})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for v, mode := range []string{"keep", "abort"} {
		st, err := h.client.PausePolicy(ctx, &rolloutv1.PausePolicyRequest{Mode: mode})
		if err != nil {
			t.Fatalf("PausePolicy %s: %v", mode, err)
		}
		apis := map[string]string{}
		for _, e := range st.GetEngines() {
			apis[e.GetBaseUrl()] = e.GetApi()
		}
		if apis[urls[0]] != llmproxy.EngineAPIVLLM || apis[urls[1]] != llmproxy.EngineAPISGLang {
			t.Errorf("%s: engines' APIs %v, want vllm then sglang", mode, apis)
		}
		for i, m := range mocks {
			if !m.Paused() {
				t.Errorf("%s: engine %d (%s) was not paused", mode, i, apis[urls[i]])
			}
		}
		if _, err := h.client.ResumePolicy(ctx, &rolloutv1.ResumePolicyRequest{Version: int32(v + 1)}); err != nil {
			t.Fatalf("ResumePolicy: %v", err)
		}
		for i, m := range mocks {
			if m.Paused() {
				t.Errorf("%s: engine %d (%s) is still paused after the resume", mode, i, apis[urls[i]])
			}
		}
	}
}
