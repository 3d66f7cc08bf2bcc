package rollout_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/services/grader"
	"github.com/osmo-rl/osmo/services/rollout"
)

// gradeLabelled rewards 1 a sample whose last answer says 42 when the
// row's label is "forty-two", else 0, and keeps the request it got.
func gradeLabelled(got *[]*graderv1.GradeRequest, mu *sync.Mutex) func(*graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	return func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
		mu.Lock()
		*got = append(*got, req)
		mu.Unlock()
		resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "label"}
		for _, s := range rollout.SamplesOf(req) {
			msgs := make([]osmo.Message, 0, len(s.GetMessages()))
			for _, m := range s.GetMessages() {
				msgs = append(msgs, m.AsMap())
			}
			r := 0.0
			if req.GetLabel() == "forty-two" && strings.Contains(osmo.LastAssistantText(msgs), "42") {
				r = 1
			}
			resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: s.GetId(), Reward: &r})
		}
		return resp, nil
	}
}

// rawSample is one sample of a grader callback as raw JSON fields, to see
// which keys were sent.
func rawSamples(t *testing.T, cb controller.G2Callback) map[string]map[string]json.RawMessage {
	t.Helper()
	var body struct {
		Samples map[string]map[string]json.RawMessage `json:"samples"`
	}
	if err := json.Unmarshal(cb.Raw, &body); err != nil {
		t.Fatalf("grader callback body: %v: %s", err, cb.Raw)
	}
	return body.Samples
}

func TestG2HappyPath(t *testing.T) {
	seen := &seenInput{}
	var mu sync.Mutex
	var gradeReqs []*graderv1.GradeRequest
	g := &fakeGrader{fn: gradeLabelled(&gradeReqs, &mu)}
	h := newHarness(t, harnessOpts{
		wf:  multiplyWorkflow(t, "solver", false, seen),
		cfg: func(c *rollout.Config) { c.Grader = g },
	})
	req := h.startReq(t, "happy-1")
	req.ExtraFields = mustStruct(t, map[string]any{"row": 7, "split": "train"})
	h.start(t, req)

	comp := h.waitCompletion(t, "happy-1")
	gcb := h.waitGrader(t, "happy-1")
	r := h.waitDone(t, "happy-1")

	// The completion callback: the exact G2 body, with the bearer.
	var compBody map[string]any
	if err := json.Unmarshal(comp.Raw, &compBody); err != nil {
		t.Fatal(err)
	}
	wantComp := map[string]any{"status": "success", "rollout_id": "happy-1", "err_message": nil, "err_category": nil}
	if !reflect.DeepEqual(compBody, wantComp) {
		t.Errorf("completion body = %s, want %v", comp.Raw, wantComp)
	}
	if got := comp.Header.Get("Authorization"); got != "Bearer "+g2CtlKey {
		t.Errorf("completion Authorization = %q", got)
	}
	if got := comp.Header.Get("Content-Type"); got != "application/json" {
		t.Errorf("completion Content-Type = %q", got)
	}

	// The grader callback: the samples keyed by id, graded.
	if gcb.Status != "success" || gcb.RolloutID != "happy-1" || gcb.ErrMessage != nil || gcb.ErrCategory != nil {
		t.Fatalf("grader callback = %s", gcb.Raw)
	}
	if gcb.Header.Get("Authorization") != "Bearer "+g2CtlKey {
		t.Errorf("grader callback Authorization = %q", gcb.Header.Get("Authorization"))
	}
	if len(gcb.Samples) != 1 {
		t.Fatalf("samples = %s", gcb.Raw)
	}
	s, ok := gcb.Samples["solver"]
	if !ok {
		t.Fatalf("no sample keyed \"solver\": %s", gcb.Raw)
	}
	for _, k := range []string{"id", "messages", "label", "reward", "remove_sample", "metrics", "extra_fields", "llm_calls"} {
		if _, ok := rawSamples(t, gcb)["solver"][k]; !ok {
			t.Errorf("sample lacks %q: %s", k, gcb.Raw)
		}
	}
	if s.ID != "solver" || s.Label == nil || *s.Label != "forty-two" || s.RemoveSample {
		t.Errorf("sample id/label/remove = %q/%v/%v", s.ID, s.Label, s.RemoveSample)
	}
	if s.Reward == nil || *s.Reward != 1 || math.IsNaN(*s.Reward) || math.IsInf(*s.Reward, 0) {
		t.Errorf("reward = %v, want 1 set by the grader", s.Reward)
	}
	if len(s.Messages) != 4 || s.Messages[0]["role"] != "user" || s.Messages[2]["role"] != "tool" || s.Messages[2]["content"] != "42" ||
		s.Messages[3]["role"] != "assistant" || !strings.Contains(fmt.Sprint(s.Messages[3]["content"]), "42") {
		t.Errorf("messages = %v", s.Messages)
	}
	if s.ExtraFields["row"] != 7.0 || s.ExtraFields["split"] != "train" || len(s.ExtraFields) != 2 {
		t.Errorf("extra_fields = %v, want the request's passed through", s.ExtraFields)
	}
	if s.Metrics["num_llm_calls"] != 2.0 || s.Metrics["num_tool_calls"] != 1.0 {
		t.Errorf("metrics = %v", s.Metrics)
	}
	if len(s.LLMCalls) != 2 || s.LLMCalls[0].RequestedModel != osmo.PlaceholderModel {
		t.Errorf("llm_calls = %v", s.LLMCalls)
	}

	// The LLM calls reached the controller as the G2 wire has them.
	chats := h.g2.Chats()
	if len(chats) != 2 {
		t.Fatalf("controller saw %d LLM calls, want 2", len(chats))
	}
	for i, c := range chats {
		if c.Header.Get("X-Rollout-Id") != "happy-1" || c.Header.Get("X-Sample-Id") != "solver" {
			t.Errorf("call %d ids = %q/%q", i, c.Header.Get("X-Rollout-Id"), c.Header.Get("X-Sample-Id"))
		}
		if c.Header.Get("Authorization") != "Bearer "+g2CtlKey {
			t.Errorf("call %d Authorization = %q", i, c.Header.Get("Authorization"))
		}
		if c.Body["model"] != "openai/osmosis-rollout" {
			t.Errorf("call %d model = %v", i, c.Body["model"])
		}
		if b, _ := json.Marshal(c.Body); strings.Contains(string(b), "forty-two") {
			t.Errorf("call %d carries the label: %s", i, b)
		}
	}

	// The workflow saw the metadata but never the label.
	if seen.count() != 1 {
		t.Fatalf("workflow ran %d times", seen.count())
	}
	if !reflect.DeepEqual(seen.metadata[0], map[string]any{"difficulty": "easy"}) {
		t.Errorf("workflow metadata = %v", seen.metadata[0])
	}
	if strings.Contains(seen.wc[0], "forty-two") {
		t.Errorf("the label reached the workflow: %s", seen.wc[0])
	}
	// The grader saw both.
	if g.count() != 1 || gradeReqs[0].GetLabel() != "forty-two" || string(gradeReqs[0].GetMetadataJson()) != `{"difficulty":"easy"}` {
		t.Errorf("grader calls %d, request %v", g.count(), gradeReqs)
	}

	st := h.status(t, "happy-1")
	if st.GetStatus() != "success" || st.Reward == nil || st.GetReward() != 1 || st.GetErrMessage() != "" || st.GetErrCategory() != "" {
		t.Errorf("status = %v", st)
	}
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || r.GetCallbackError() != "" || r.GetWorkflow() != "multiply-test" {
		t.Errorf("rollout = %v", r)
	}
	if n, m := len(h.g2.Completions("happy-1")), len(h.g2.GraderCallbacks("happy-1")); n != 1 || m != 1 {
		t.Errorf("%d completion and %d grader callbacks, want 1 each", n, m)
	}
}

func TestG2RecordedConversationIsTheSample(t *testing.T) {
	h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", true, nil)})
	h.start(t, h.startReq(t, "rec-1"))
	gcb := h.waitGrader(t, "rec-1")
	s := gcb.Samples["solver"]
	// The last call's request (user, tool call, tool result) and its answer.
	if gcb.Status != "success" || len(s.Messages) != 4 {
		t.Fatalf("grader callback = %s", gcb.Raw)
	}
	if s.Messages[0]["content"] != "What is 6 times 7?" || s.Messages[1]["tool_calls"] == nil || s.Messages[2]["role"] != "tool" {
		t.Errorf("messages = %v", s.Messages)
	}
	if last := s.Messages[3]; last["role"] != "assistant" || !strings.Contains(fmt.Sprint(last["content"]), "42") {
		t.Errorf("last message = %v", last)
	}
}

// TestG2LLMCallRecords checks the per-call records of the grader callback
// against PROTOCOL.md (G3): the flat prompt_tokens, completion_tokens,
// cached_tokens and model_name beside osmo's own usage and model, and token
// ids and logprobs only when the policy returned them, never as [].
func TestG2LLMCallRecords(t *testing.T) {
	wf := mustWorkflow(t, "records", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		for _, s := range []struct {
			id    string
			extra map[string]any
		}{
			{"plain", nil},
			{"exact", map[string]any{"logprobs": true, "return_token_ids": true}},
		} {
			if _, err := chatOnceWith(ctx, wc.Rollout.Endpoint(s.id), wc.Prompt, nil, s.extra); err != nil {
				return err
			}
			if err := wc.Rollout.Register(s.id, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return nil, nil })); err != nil {
				return err
			}
		}
		return nil
	})
	// Rows off: the proxy asks nothing, so the plain call's policy
	// returns no tokens.
	h := newHarness(t, harnessOpts{wf: wf, cfg: func(c *rollout.Config) { c.Rows = false }})
	h.start(t, h.startReq(t, "calls-1"))
	gcb := h.waitGrader(t, "calls-1")
	if gcb.Status != "success" {
		t.Fatalf("grader callback = %s", gcb.Raw)
	}
	var body struct {
		Samples map[string]struct {
			LLMCalls []map[string]json.RawMessage `json:"llm_calls"`
		} `json:"samples"`
	}
	if err := json.Unmarshal(gcb.Raw, &body); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"plain", "exact"} {
		calls := body.Samples[id].LLMCalls
		if len(calls) != 1 {
			t.Fatalf("sample %s: %d llm_calls, want 1: %s", id, len(calls), gcb.Raw)
		}
		c := calls[0]
		var usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			CachedTokens     int `json:"cached_tokens"`
		}
		if err := json.Unmarshal(c["usage"], &usage); err != nil || usage.PromptTokens == 0 || usage.CompletionTokens == 0 {
			t.Errorf("%s: usage = %s (%v)", id, c["usage"], err)
		}
		for k, want := range map[string]string{
			"prompt_tokens":     fmt.Sprint(usage.PromptTokens),
			"completion_tokens": fmt.Sprint(usage.CompletionTokens),
			"cached_tokens":     fmt.Sprint(usage.CachedTokens),
			"model_name":        `"` + osmo.PlaceholderModel + `"`,
			"model":             `"` + osmo.PlaceholderModel + `"`,
			"requested_model":   `"` + osmo.PlaceholderModel + `"`,
			"api":               `"chat.completions"`,
		} {
			if got := string(c[k]); got != want {
				t.Errorf("%s: %s = %s, want %s", id, k, got, want)
			}
		}
		for _, k := range []string{"prompt_token_ids", "completion_token_ids", "logprobs"} {
			raw, ok := c[k]
			switch {
			case id == "plain" && ok:
				t.Errorf("%s: %s = %s sent though the policy returned none; want it left out", id, k, raw)
			case id == "exact" && (!ok || strings.HasPrefix(string(raw), "[]") || !strings.HasPrefix(string(raw), "[")):
				t.Errorf("%s: %s = %s, want the policy's values", id, k, raw)
			}
		}
	}
	// GET /v1/rollouts/{id} (and gRPC) carry usage and model under their
	// own names, once.
	r := h.waitDone(t, "calls-1")
	for _, sm := range r.GetSamples() {
		for _, c := range sm.GetLlmCalls() {
			if c.GetUsage().GetPromptTokens() == 0 || c.GetModel() == "" {
				t.Errorf("sample %s: call record %v", sm.GetId(), c)
			}
		}
	}
}

func TestG2GradingGates(t *testing.T) {
	for _, tc := range []struct {
		name       string
		grader     bool
		edit       func(*rolloutv1.StartRolloutRequest)
		wantGrades int
		wantReward *float64
		graderCB   bool
	}{
		{"no grader", false, nil, 0, nil, true},
		{"no label nor metadata", true, func(r *rolloutv1.StartRolloutRequest) { r.Label, r.Metadata = nil, nil }, 0, nil, true},
		{"null label, no metadata", true, func(r *rolloutv1.StartRolloutRequest) { r.Label, r.Metadata = structpb.NewNullValue(), nil }, 0, nil, true},
		{"label only", true, func(r *rolloutv1.StartRolloutRequest) { r.Metadata = nil }, 1, proto.Float64(1), true},
		{"metadata only", true, func(r *rolloutv1.StartRolloutRequest) { r.Label = nil }, 1, proto.Float64(0), true},
		{"no grader_callback_url", true, func(r *rolloutv1.StartRolloutRequest) { r.GraderCallbackUrl = nil }, 1, proto.Float64(1), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var reqs []*graderv1.GradeRequest
			g := &fakeGrader{fn: gradeLabelled(&reqs, &mu)}
			logDir := t.TempDir()
			h := newHarness(t, harnessOpts{
				wf: multiplyWorkflow(t, "solver", false, nil),
				cfg: func(c *rollout.Config) {
					c.LogDir = logDir
					if tc.grader {
						c.Grader = g
					}
				},
			})
			req := h.startReq(t, "gate-1")
			if tc.edit != nil {
				tc.edit(req)
			}
			h.start(t, req)
			comp := h.waitCompletion(t, "gate-1")
			h.waitDone(t, "gate-1")
			if comp.Status != "success" {
				t.Fatalf("completion = %s", comp.Raw)
			}
			if g.count() != tc.wantGrades {
				t.Errorf("grader ran %d times, want %d", g.count(), tc.wantGrades)
			}
			cbs := h.g2.GraderCallbacks("gate-1")
			if !tc.graderCB {
				if len(cbs) != 0 {
					t.Fatalf("grader callback posted without a grader_callback_url: %s", cbs[0].Raw)
				}
			} else {
				if len(cbs) != 1 {
					t.Fatalf("%d grader callbacks, want 1", len(cbs))
				}
				s := cbs[0].Samples["solver"]
				if cbs[0].Status != "success" || !reflect.DeepEqual(s.Reward, tc.wantReward) {
					t.Errorf("grader callback = %s, want reward %v", cbs[0].Raw, tc.wantReward)
				}
				if got := string(rawSamples(t, cbs[0])["solver"]["reward"]); got != ptrOr(tc.wantReward) {
					t.Errorf("reward on the wire = %s, want %s", got, ptrOr(tc.wantReward))
				}
			}
			if n := len(h.g2.Completions("gate-1")); n != 1 {
				t.Errorf("%d completions, want 1", n)
			}
			st := h.status(t, "gate-1")
			if st.GetStatus() != "success" || !reflect.DeepEqual(st.Reward, tc.wantReward) {
				t.Errorf("status = %v, want reward %v", st, tc.wantReward)
			}
			want := map[string]bool{
				"start_request": true, "start": true, "llm_call": true, "completion_callback": true,
				"grader_callback": tc.graderCB, "graded": tc.wantGrades > 0, "grading_skipped": tc.wantGrades == 0,
			}
			got := eventNames(t, filepath.Join(logDir, "*", "rollout-gate-1.jsonl"))
			for ev, w := range want {
				if got[ev] != w {
					t.Errorf("event log has %s: %v, want %v (events %v)", ev, got[ev], w, got)
				}
			}
		})
	}
}

// eventNames reads the one event log file matching pattern: the events it
// holds, each record checked to carry rollout_id and ts.
func eventNames(t *testing.T, pattern string) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(pattern)
	if err != nil || len(files) != 1 {
		t.Fatalf("event log files %v %v", files, err)
	}
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var rec struct {
			Event     string `json:"event"`
			RolloutID string `json:"rollout_id"`
			TS        string `json:"ts"`
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil || rec.Event == "" || rec.RolloutID == "" || rec.TS == "" {
			t.Errorf("event record %s: %v", line, err)
		}
		names[rec.Event] = true
	}
	return names
}

// ptrOr renders p as the JSON text of its value, "null" when nil.
func ptrOr(p *float64) string {
	if p == nil {
		return "null"
	}
	return fmt.Sprint(*p)
}

func TestG2StartValidation(t *testing.T) {
	h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil)})
	big := strings.Repeat("x", 2<<20)
	for _, tc := range []struct {
		name  string
		edit  func(*rolloutv1.StartRolloutRequest)
		field string
	}{
		{"blank id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "  " }, "rollout_id"},
		{"empty id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "" }, "rollout_id"},
		{"id with slash", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "a/b" }, "rollout_id"},
		{"id with backslash", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = `a\b` }, "rollout_id"},
		{"id ..", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = ".." }, "rollout_id"},
		{"id .", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "." }, "rollout_id"},
		{"id with NUL", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "a\x00b" }, "rollout_id"},
		{"id with newline", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = "a\nb" }, "rollout_id"},
		{"long id", func(r *rolloutv1.StartRolloutRequest) { r.RolloutId = strings.Repeat("a", 257) }, "rollout_id"},
		{"empty controller_api_key", func(r *rolloutv1.StartRolloutRequest) { r.ControllerApiKey = proto.String("") }, "controller_api_key"},
		{"blank controller_api_key", func(r *rolloutv1.StartRolloutRequest) { r.ControllerApiKey = proto.String(" ") }, "controller_api_key"},
		{"controller_api_key with a line break", func(r *rolloutv1.StartRolloutRequest) { r.ControllerApiKey = proto.String("k\r\nX-Injected: 1") }, "controller_api_key"},
		{"negative agent_timeout_sec", func(r *rolloutv1.StartRolloutRequest) { r.AgentTimeoutSec = proto.Float64(-1) }, "agent_timeout_sec"},
		{"zero agent_timeout_sec", func(r *rolloutv1.StartRolloutRequest) { r.AgentTimeoutSec = proto.Float64(0) }, "agent_timeout_sec"},
		{"NaN grader_timeout_sec", func(r *rolloutv1.StartRolloutRequest) { r.GraderTimeoutSec = proto.Float64(math.NaN()) }, "grader_timeout_sec"},
		{"missing chat_completions_url", func(r *rolloutv1.StartRolloutRequest) { r.ChatCompletionsUrl = "" }, "chat_completions_url"},
		{"ftp chat_completions_url", func(r *rolloutv1.StartRolloutRequest) { r.ChatCompletionsUrl = "ftp://x/v1" }, "chat_completions_url"},
		{"missing completion_callback_url", func(r *rolloutv1.StartRolloutRequest) { r.CompletionCallbackUrl = "" }, "completion_callback_url"},
		{"empty grader_callback_url", func(r *rolloutv1.StartRolloutRequest) { r.GraderCallbackUrl = proto.String("") }, "grader_callback_url"},
		{"object label", func(r *rolloutv1.StartRolloutRequest) {
			r.Label = structpb.NewStructValue(mustStruct(t, map[string]any{"a": 1}))
		}, "label"},
		{"metadata too large", func(r *rolloutv1.StartRolloutRequest) {
			r.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{"blob": structpb.NewStringValue(big)}}
		}, "metadata"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := h.startReq(t, "v-1")
			tc.edit(req)
			_, err := h.client.StartRollout(context.Background(), req)
			st := status.Convert(err)
			if st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), tc.field+":") {
				t.Fatalf("got %v, want InvalidArgument naming %s", err, tc.field)
			}
			var named bool
			for _, d := range st.Details() {
				if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) == 1 && br.GetFieldViolations()[0].GetField() == tc.field {
					named = true
				}
			}
			if !named {
				t.Errorf("no BadRequest detail naming %s: %v", tc.field, st.Details())
			}
		})
	}
	// Nothing was started or called (the refusals' callbacks are
	// TestG2RejectedStartCallbacks's).
	if st := h.status(t, "v-1"); st.GetStatus() != "unknown" {
		t.Errorf("a refused start left a rollout: %v", st)
	}
	if hr := h.health(t); hr.GetActiveRollouts() != 0 || hr.GetConcurrency().GetQueued() != 0 {
		t.Errorf("health after refused starts = %v", hr)
	}
	if n := len(h.g2.Chats()); n != 0 {
		t.Errorf("refused starts made %d LLM calls", n)
	}
	// Numeric labels are fine (taken as text), and the service still serves.
	ok := h.startReq(t, "v-ok")
	ok.Label = structpb.NewNumberValue(42)
	h.start(t, ok)
	if c := h.waitCompletion(t, "v-ok"); c.Status != "success" {
		t.Fatalf("valid start after refused ones: %s", c.Raw)
	}
	if g := h.waitGrader(t, "v-ok"); g.Samples["solver"].Label == nil || *g.Samples["solver"].Label != "42" {
		t.Fatalf("numeric label = %s", g.Raw)
	}
}

func TestG2CancelAndStatusValidation(t *testing.T) {
	h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil)})
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		req   *rolloutv1.CancelRolloutsRequest
		field string
	}{
		{"no selector", &rolloutv1.CancelRolloutsRequest{}, "ids"},
		{"ids and all", &rolloutv1.CancelRolloutsRequest{Ids: []string{"a"}, All: true}, "ids"},
		{"ids and prefix", &rolloutv1.CancelRolloutsRequest{Ids: []string{"a"}, Prefix: proto.String("a")}, "ids"},
		{"prefix and all", &rolloutv1.CancelRolloutsRequest{Prefix: proto.String("a"), All: true}, "ids"},
		{"empty prefix", &rolloutv1.CancelRolloutsRequest{Prefix: proto.String("")}, "prefix"},
		{"empty id", &rolloutv1.CancelRolloutsRequest{Ids: []string{"a", ""}}, "ids"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.client.CancelRollouts(ctx, tc.req)
			if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), tc.field+":") {
				t.Fatalf("got %v, want InvalidArgument naming %s", err, tc.field)
			}
		})
	}
	if _, err := h.client.GetRolloutStatus(ctx, &rolloutv1.GetRolloutStatusRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("status without an id: %v", err)
	}
	if st := h.status(t, "never-seen"); st.GetStatus() != "unknown" || st.GetRolloutId() != "never-seen" || st.Reward != nil {
		t.Errorf("status of an unknown id = %v", st)
	}
}

// failureCase is a workflow (or policy) that fails one way.
type failureCase struct {
	name     string
	wf       func(t *testing.T) *osmo.Workflow
	opts     func(*harnessOpts)
	edit     func(*rolloutv1.StartRolloutRequest)
	category string
	contains string
}

func TestG2WorkflowFailures(t *testing.T) {
	register := func(wc *osmo.WorkflowContext[testWFConfig], id string) error {
		return wc.Rollout.Register(id, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return osmo.EncodeMessages([]osmo.Message{{"role": "assistant", "content": "partial"}})
		}))
	}
	for _, tc := range []failureCase{
		{
			name: "panic",
			wf: func(t *testing.T) *osmo.Workflow {
				return mustWorkflow(t, "panicky", func(_ context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
					if err := register(wc, "s"); err != nil {
						return err
					}
					panic("nil map write")
				})
			},
			category: "agent_error", contains: "workflow panicked: nil map write",
		},
		{
			name: "invalid input",
			wf: func(t *testing.T) *osmo.Workflow {
				return mustWorkflow(t, "picky", func(context.Context, *osmo.WorkflowContext[testWFConfig]) error {
					return fmt.Errorf("picky: prompt has no question: %w", osmo.ErrInvalidInput)
				})
			},
			category: "validation_error", contains: "prompt has no question",
		},
		{
			name: "agent timeout",
			wf: func(t *testing.T) *osmo.Workflow {
				return mustWorkflow(t, "slow", func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
					if err := register(wc, "s"); err != nil {
						return err
					}
					<-ctx.Done()
					return ctx.Err()
				})
			},
			edit:     func(r *rolloutv1.StartRolloutRequest) { r.AgentTimeoutSec = proto.Float64(0.3) },
			category: "timeout", contains: "agent_timeout_sec",
		},
		{
			name: "duplicate sample id",
			wf: func(t *testing.T) *osmo.Workflow {
				return mustWorkflow(t, "twins", func(_ context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
					if err := register(wc, "twin"); err != nil {
						return err
					}
					return register(wc, "twin")
				})
			},
			category: "agent_error", contains: "duplicate sample id",
		},
		{
			name: "no sample source",
			wf: func(t *testing.T) *osmo.Workflow {
				return mustWorkflow(t, "empty", func(context.Context, *osmo.WorkflowContext[testWFConfig]) error { return nil })
			},
			category: "agent_error", contains: "without registering any sample source",
		},
		{
			name: "sample source fails",
			wf: func(t *testing.T) *osmo.Workflow {
				return mustWorkflow(t, "broken-source", func(_ context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
					return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
						return nil, errors.New("transcript lost")
					}))
				})
			},
			category: "agent_error", contains: "transcript lost",
		},
		{
			name:     "policy always 500",
			wf:       func(t *testing.T) *osmo.Workflow { return multiplyWorkflow(t, "solver", false, nil) },
			opts:     func(o *harnessOpts) { o.mock = mockOpts("500") },
			category: "http_error", contains: "HTTP 502",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
				return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Error: "must not be asked"}, nil
			}}
			o := harnessOpts{wf: tc.wf(t), cfg: func(c *rollout.Config) { c.Grader = g }}
			if tc.opts != nil {
				tc.opts(&o)
			}
			h := newHarness(t, o)
			req := h.startReq(t, "f-1")
			if tc.edit != nil {
				tc.edit(req)
			}
			began := time.Now()
			h.start(t, req)
			comp := h.waitCompletion(t, "f-1")
			elapsed := time.Since(began)
			gcb := h.waitGrader(t, "f-1")
			h.waitDone(t, "f-1")

			assertFailure(t, "completion", comp, tc.category, tc.contains)
			assertFailure(t, "grader callback", gcb, tc.category, tc.contains)
			for id, s := range gcb.Samples {
				if s.Reward != nil {
					t.Errorf("sample %s of a failed rollout has reward %v", id, *s.Reward)
				}
			}
			if g.count() != 0 {
				t.Errorf("a failed workflow was graded")
			}
			st := h.status(t, "f-1")
			if st.GetStatus() != "failure" || st.GetErrCategory() != tc.category || !strings.Contains(st.GetErrMessage(), tc.contains) || st.Reward != nil {
				t.Errorf("status = %v", st)
			}
			if n, m := len(h.g2.Completions("f-1")), len(h.g2.GraderCallbacks("f-1")); n != 1 || m != 1 {
				t.Errorf("%d completions and %d grader callbacks, want 1 each", n, m)
			}
			if tc.category == "timeout" && (elapsed < 300*time.Millisecond || elapsed > 3*time.Second) {
				t.Errorf("timeout completion arrived after %v for a 0.3s budget", elapsed)
			}
		})
	}
}

func assertFailure(t *testing.T, what string, cb controller.G2Callback, category, contains string) {
	t.Helper()
	if cb.Status != "failure" || cb.ErrCategory == nil || *cb.ErrCategory != category ||
		cb.ErrMessage == nil || !strings.Contains(*cb.ErrMessage, contains) {
		t.Errorf("%s = %s, want failure %s mentioning %q", what, cb.Raw, category, contains)
	}
}

// TestG2TimeoutWithWorkflowIgnoringContext: a workflow stuck in code that
// does not watch its context must still be reported as timed out on time;
// the trainer's rollout cannot wait for it.
func TestG2TimeoutWithWorkflowIgnoringContext(t *testing.T) {
	release := make(chan struct{})
	wf := mustWorkflow(t, "stuck", func(_ context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		<-release
		return errors.New("released")
	})
	h := newHarness(t, harnessOpts{wf: wf})
	t.Cleanup(func() { close(release) }) // runs before the harness stops
	req := h.startReq(t, "stuck-1")
	req.AgentTimeoutSec = proto.Float64(0.3)
	h.start(t, req)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	comp, err := h.g2.WaitCompletion(ctx, "stuck-1")
	if err != nil {
		t.Fatalf("no completion 3s after a 0.3s agent_timeout_sec: %v", err)
	}
	assertFailure(t, "completion", comp, "timeout", "agent_timeout_sec")
}

// TestG2GraderFailures: grading that does not give every sample a finite
// reward fails the grader callback as validation_error, without rewards;
// the completion (the workflow's outcome) is still success.
func TestG2GraderFailures(t *testing.T) {
	graderService := func(name string, fn osmo.GraderFunc) func(t *testing.T) rollout.Grader {
		return func(t *testing.T) rollout.Grader {
			svc, err := grader.New(t.Context(), grader.Config{Graders: map[string]osmo.Grader{name: fn}, Default: name, State: newGraderState(t), Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = svc.Close() })
			return svc
		}
	}
	fake := func(grade func(id string) *graderv1.SampleGrade) func(t *testing.T) rollout.Grader {
		return func(*testing.T) rollout.Grader {
			return &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
				resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "fake"}
				for _, s := range rollout.SamplesOf(req) {
					if g := grade(s.GetId()); g != nil {
						resp.Grades = append(resp.Grades, g)
					}
				}
				return resp, nil
			}}
		}
	}
	for _, tc := range []struct {
		name   string
		grader func(t *testing.T) rollout.Grader
	}{
		{"grader service: NaN reward", graderService("nan", func(_ context.Context, gc *osmo.GraderContext) error {
			for id := range gc.Samples {
				_ = gc.SetSampleReward(id, math.NaN()) // refused, so the sample stays ungraded
			}
			return nil
		})},
		{"grader service: sample left ungraded", graderService("lazy", func(context.Context, *osmo.GraderContext) error { return nil })},
		{"validation_error answer", func(*testing.T) rollout.Grader {
			return &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
				return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Error: `grader "x": left samples without a reward`, ErrorCategory: "validation_error"}, nil
			}}
		}},
		{"grader answers NaN", fake(func(id string) *graderv1.SampleGrade {
			return &graderv1.SampleGrade{SampleId: id, Reward: proto.Float64(math.NaN())}
		})},
		{"grader answers +Inf", fake(func(id string) *graderv1.SampleGrade {
			return &graderv1.SampleGrade{SampleId: id, Reward: proto.Float64(math.Inf(1))}
		})},
		{"grader omits a sample", fake(func(string) *graderv1.SampleGrade { return nil })},
		{"grader gives neither reward nor removal", fake(func(id string) *graderv1.SampleGrade {
			return &graderv1.SampleGrade{SampleId: id}
		})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gr := tc.grader(t)
			h := newHarness(t, harnessOpts{
				wf:  multiplyWorkflow(t, "solver", false, nil),
				cfg: func(c *rollout.Config) { c.Grader = gr },
			})
			h.start(t, h.startReq(t, "gf-1"))
			comp := h.waitCompletion(t, "gf-1")
			if comp.Status != "success" {
				t.Errorf("completion = %s, want success (the workflow succeeded)", comp.Raw)
			}
			// Once the rollout is done its callbacks were posted (or given up on).
			r := h.waitDone(t, "gf-1")
			cbs := h.g2.GraderCallbacks("gf-1")
			if len(cbs) != 1 {
				t.Fatalf("%d grader callbacks (callback_error %q), want 1", len(cbs), r.GetCallbackError())
			}
			gcb := cbs[0]
			assertFailure(t, "grader callback", gcb, "validation_error", "")
			if s, ok := gcb.Samples["solver"]; !ok || s.Reward != nil || len(s.Messages) == 0 {
				t.Errorf("sample = %+v (present %v), want its messages and a null reward", s, ok)
			}
			st := h.status(t, "gf-1")
			if st.GetStatus() != "failure" || st.GetErrCategory() != "validation_error" || st.Reward != nil {
				t.Errorf("status = %v", st)
			}
			if n, m := len(h.g2.Completions("gf-1")), len(h.g2.GraderCallbacks("gf-1")); n != 1 || m != 1 {
				t.Errorf("%d completions and %d grader callbacks, want 1 each", n, m)
			}
		})
	}
}

// TestG2GetRolloutWhileGrading reads a rollout while its grader runs: the
// answer shows the grading state, and it is a snapshot that the grading
// finishing later does not change (a gRPC server encodes it after the
// call returned, without the service's lock).
func TestG2GetRolloutWhileGrading(t *testing.T) {
	grading := make(chan struct{})
	proceed := make(chan struct{})
	var mu sync.Mutex
	var reqs []*graderv1.GradeRequest
	grade := gradeLabelled(&reqs, &mu)
	g := &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
		close(grading)
		<-proceed
		return grade(req)
	}}
	h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil), cfg: func(c *rollout.Config) { c.Grader = g }})
	h.start(t, h.startReq(t, "wg-1"))
	select {
	case <-grading:
	case <-time.After(5 * time.Second):
		t.Fatal("grading never started")
	}
	if st := h.status(t, "wg-1"); st.GetStatus() != "grading" || st.Reward != nil {
		t.Errorf("status while grading = %v", st)
	}
	r, err := h.client.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: "wg-1"})
	if err != nil || r.GetState() != rolloutv1.State_STATE_GRADING || len(r.GetSamples()) != 1 || r.GetSamples()[0].Reward != nil {
		t.Fatalf("rollout while grading = %v, %v", r, err)
	}
	snap, err := h.svc.GetRollout(context.Background(), &rolloutv1.GetRolloutRequest{RolloutId: "wg-1"})
	if err != nil {
		t.Fatal(err)
	}
	close(proceed)
	h.waitGrader(t, "wg-1")
	r = h.waitDone(t, "wg-1")
	if r.GetState() != rolloutv1.State_STATE_SUCCEEDED || r.GetSamples()[0].GetReward() != 1 || r.GetReward() != 1 {
		t.Errorf("rollout after grading = %v", r)
	}
	if s := snap.GetSamples()[0]; s.Reward != nil || snap.GetState() != rolloutv1.State_STATE_GRADING {
		t.Errorf("a GetRollout answer changed after it was returned: state %v, sample reward %v", snap.GetState(), *s.Reward)
	}
}

func TestG2CallbackDelivery(t *testing.T) {
	for _, tc := range []struct {
		name       string
		fail       int
		status     int
		wantFailed int
		delivered  bool
		cbErr      string
	}{
		{"503 twice, delivered on the third attempt", 2, 503, 2, true, ""},
		{"429 is retried", 1, 429, 1, true, ""},
		{"400 is not retried", 1, 400, 1, false, "HTTP 400"},
		{"gives up at the delivery deadline", 1000, 503, -1, false, "over the delivery deadline (3s)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, harnessOpts{
				wf: multiplyWorkflow(t, "solver", false, nil),
				g2: controller.G2Options{FailCallbacks: tc.fail, FailStatus: tc.status},
			})
			req := h.startReq(t, "cb-1")
			req.GraderCallbackUrl = nil // only the completion is posted
			h.start(t, req)
			r := h.waitDone(t, "cb-1")
			if got := h.g2.FailedCallbacks(); got != tc.wantFailed && !(tc.wantFailed < 0 && got > 10) {
				t.Errorf("%d failed attempts, want %d (-1: many)", got, tc.wantFailed)
			}
			comps := h.g2.Completions("cb-1")
			if tc.delivered {
				if len(comps) != 1 || comps[0].Status != "success" {
					t.Fatalf("completions = %v", comps)
				}
				if r.GetCallbackError() != "" {
					t.Errorf("callback_error = %q", r.GetCallbackError())
				}
				return
			}
			if len(comps) != 0 {
				t.Fatalf("%d completions recorded, want none", len(comps))
			}
			if ce := r.GetCallbackError(); !strings.Contains(ce, "completion") || !strings.Contains(ce, tc.cbErr) {
				t.Errorf("callback_error = %q, want it to name the completion and %q", ce, tc.cbErr)
			}
			// The rollout itself succeeded; only the delivery failed.
			if st := h.status(t, "cb-1"); st.GetStatus() != "success" {
				t.Errorf("status = %v", st)
			}
		})
	}
}

func TestG2Capacity(t *testing.T) {
	b := newBlockingWorkflow()
	reg := prometheus.NewRegistry()
	h := newHarness(t, harnessOpts{wf: b.workflow(t), cfg: func(c *rollout.Config) { c.MaxConcurrent, c.MaxQueued, c.Metrics = 1, 1, reg }})
	ctx := context.Background()
	h.start(t, h.startReq(t, "cap-a"))
	b.waitStarted(t, "cap-a")
	h.start(t, h.startReq(t, "cap-b"))
	h.waitHealth(t, "1 running, 1 queued", func(c *rolloutv1.Concurrency) bool { return c.GetRunning() == 1 && c.GetQueued() == 1 })

	_, err := h.client.StartRollout(ctx, h.startReq(t, "cap-c"))
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "capacity") {
		t.Fatalf("third start: %v, want ResourceExhausted", err)
	}
	var retry *errdetails.RetryInfo
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			retry = ri
		}
	}
	if retry == nil || retry.GetRetryDelay().AsDuration() != 5*time.Second {
		t.Fatalf("RetryInfo = %v, want a 5s retry delay", retry)
	}
	for reason, want := range map[string]float64{"capacity": 1, "invalid": 0} {
		if got, err := gatherValue(reg, "osmo_rollouts_rejected_total", reason); err != nil || got != want {
			t.Errorf("osmo_rollouts_rejected_total{reason=%q} = %v (%v), want %v", reason, got, err, want)
		}
	}
	if s := h.status(t, "cap-c"); s.GetStatus() != "unknown" {
		t.Errorf("a refused start was admitted: %v", s)
	}
	// A duplicate of an admitted rollout is not new work: accepted at capacity.
	if _, err := h.client.StartRollout(ctx, h.startReq(t, "cap-a")); err != nil {
		t.Errorf("duplicate start at capacity: %v", err)
	}

	resp, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{"cap-b"}})
	if err != nil || resp.GetDispositions()["cap-b"] != "cancelled_queued" {
		t.Fatalf("cancel cap-b: %v %v", resp, err)
	}
	h.waitHealth(t, "the queue slot free", func(c *rolloutv1.Concurrency) bool { return c.GetQueued() == 0 })
	h.start(t, h.startReq(t, "cap-c"))
	h.waitDone(t, "cap-b")
	if s := h.status(t, "cap-c"); s.GetStatus() != "queued" {
		t.Errorf("cap-c after capacity returned: %v", s)
	}
	resp, err = h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{All: true})
	want := map[string]string{"cap-a": "cancelled_running", "cap-c": "cancelled_queued"}
	if err != nil || !reflect.DeepEqual(resp.GetDispositions(), want) {
		t.Fatalf("cancel all: %v %v, want %v", resp, err, want)
	}
	for _, id := range []string{"cap-a", "cap-b", "cap-c"} {
		if c := h.waitCompletion(t, id); c.Status != "cancelled" {
			t.Errorf("%s completion = %s", id, c.Raw)
		}
		h.waitDone(t, id)
	}
	if ran := b.ran(); !slices.Equal(ran, []string{"cap-a"}) {
		t.Errorf("workflows ran for %v, want only cap-a", ran)
	}
	h.waitHealth(t, "nothing left", func(c *rolloutv1.Concurrency) bool { return c.GetQueued() == 0 && c.GetRunning() == 0 })
}

func TestG2Cancel(t *testing.T) {
	ctx := context.Background()
	t.Run("running and unknown by ids", func(t *testing.T) {
		b := newBlockingWorkflow()
		h := newHarness(t, harnessOpts{wf: b.workflow(t)})
		h.start(t, h.startReq(t, "run-1"))
		b.waitStarted(t, "run-1")
		if s := h.status(t, "run-1"); s.GetStatus() != "running" {
			t.Errorf("status = %v", s)
		}
		resp, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{"run-1", "nope"}})
		want := map[string]string{"run-1": "cancelled_running", "nope": "not_found"}
		if err != nil || !reflect.DeepEqual(resp.GetDispositions(), want) {
			t.Fatalf("cancel = %v %v, want %v", resp, err, want)
		}
		comp := h.waitCompletion(t, "run-1")
		gcb := h.waitGrader(t, "run-1")
		h.waitDone(t, "run-1")
		var body map[string]any
		if err := json.Unmarshal(comp.Raw, &body); err != nil {
			t.Fatal(err)
		}
		if body["status"] != "cancelled" || body["rollout_id"] != "run-1" || body["err_category"] != nil {
			t.Errorf("completion = %s", comp.Raw)
		}
		if _, ok := body["err_category"]; !ok {
			t.Errorf("completion lacks err_category: %s", comp.Raw)
		}
		// Neither SDK generation's grader status has "cancelled": the
		// grader callback is a failure saying so, without a category.
		if gcb.Status != "failure" || gcb.ErrCategory != nil || gcb.ErrMessage == nil || !strings.Contains(*gcb.ErrMessage, "cancelled by request") ||
			gcb.Samples["blocker"].Reward != nil || !strings.Contains(string(gcb.Raw), `"sample":null`) {
			t.Errorf("grader callback = %s", gcb.Raw)
		}
		if cause := b.cause("run-1"); cause == nil || !strings.Contains(cause.Error(), "cancelled") {
			t.Errorf("workflow context ended with %v, want the cancellation", cause)
		}
		if s := h.status(t, "run-1"); s.GetStatus() != "cancelled" || s.GetErrCategory() != "" {
			t.Errorf("status = %v", s)
		}
		// A finished rollout is not found for cancelling, and nothing is posted twice.
		resp, err = h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{"run-1"}})
		if err != nil || resp.GetDispositions()["run-1"] != "not_found" {
			t.Errorf("second cancel = %v %v", resp, err)
		}
		if n, m := len(h.g2.Completions("run-1")), len(h.g2.GraderCallbacks("run-1")); n != 1 || m != 1 {
			t.Errorf("%d completions and %d grader callbacks, want 1 each", n, m)
		}
	})

	t.Run("queued never runs", func(t *testing.T) {
		b := newBlockingWorkflow()
		h := newHarness(t, harnessOpts{wf: b.workflow(t), cfg: func(c *rollout.Config) { c.MaxConcurrent = 1 }})
		h.start(t, h.startReq(t, "q-a"))
		b.waitStarted(t, "q-a")
		h.start(t, h.startReq(t, "q-b"))
		if s := h.status(t, "q-b"); s.GetStatus() != "queued" {
			t.Fatalf("q-b = %v", s)
		}
		resp, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{"q-b"}})
		if err != nil || resp.GetDispositions()["q-b"] != "cancelled_queued" {
			t.Fatalf("cancel = %v %v", resp, err)
		}
		if c := h.waitCompletion(t, "q-b"); c.Status != "cancelled" || c.ErrCategory != nil {
			t.Errorf("completion = %s", c.Raw)
		}
		h.waitDone(t, "q-b")
		if s := h.status(t, "q-a"); s.GetStatus() != "running" {
			t.Errorf("cancelling q-b touched q-a: %v", s)
		}
		if _, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{"q-a"}}); err != nil {
			t.Fatal(err)
		}
		h.waitDone(t, "q-a")
		if ran := b.ran(); !slices.Equal(ran, []string{"q-a"}) {
			t.Errorf("workflows ran for %v, want only q-a", ran)
		}
	})

	t.Run("prefix then all", func(t *testing.T) {
		b := newBlockingWorkflow()
		h := newHarness(t, harnessOpts{wf: b.workflow(t)})
		for _, id := range []string{"p-1", "p-2", "q-1"} {
			h.start(t, h.startReq(t, id))
			b.waitStarted(t, id)
		}
		resp, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Prefix: proto.String("p-")})
		want := map[string]string{"p-1": "cancelled_running", "p-2": "cancelled_running"}
		if err != nil || !reflect.DeepEqual(resp.GetDispositions(), want) {
			t.Fatalf("cancel prefix = %v %v, want %v", resp, err, want)
		}
		for _, id := range []string{"p-1", "p-2"} {
			h.waitDone(t, id)
		}
		if s := h.status(t, "q-1"); s.GetStatus() != "running" {
			t.Errorf("q-1 after cancelling p- = %v", s)
		}
		resp, err = h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{All: true})
		if err != nil || !reflect.DeepEqual(resp.GetDispositions(), map[string]string{"q-1": "cancelled_running"}) {
			t.Fatalf("cancel all = %v %v", resp, err)
		}
		for _, id := range []string{"p-1", "p-2", "q-1"} {
			h.waitDone(t, id)
			if comps := h.g2.Completions(id); len(comps) != 1 || comps[0].Status != "cancelled" {
				t.Errorf("%s completions = %v", id, comps)
			}
		}
	})

	t.Run("in-flight LLM call is aborted upstream", func(t *testing.T) {
		arrived := make(chan struct{}, 4)
		aborted := make(chan struct{}, 4)
		policy := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			arrived <- struct{}{}
			select {
			case <-r.Context().Done():
				aborted <- struct{}{}
			case <-time.After(10 * time.Second):
				http.Error(w, "not aborted", http.StatusInternalServerError)
			}
		})
		h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, nil), policy: policy})
		h.start(t, h.startReq(t, "llm-1"))
		select {
		case <-arrived:
		case <-time.After(5 * time.Second):
			t.Fatal("the LLM call never reached the policy")
		}
		resp, err := h.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{"llm-1"}})
		if err != nil || resp.GetDispositions()["llm-1"] != "cancelled_running" {
			t.Fatalf("cancel = %v %v", resp, err)
		}
		select {
		case <-aborted:
		case <-time.After(5 * time.Second):
			t.Fatal("the policy's request was not aborted within 5s of the cancel")
		}
		if c := h.waitCompletion(t, "llm-1"); c.Status != "cancelled" {
			t.Errorf("completion = %s", c.Raw)
		}
		h.waitDone(t, "llm-1")
		if n := len(h.g2.Completions("llm-1")); n != 1 {
			t.Errorf("%d completions, want 1", n)
		}
		if s := h.status(t, "llm-1"); s.GetStatus() != "cancelled" {
			t.Errorf("status = %v", s)
		}
	})
}

func TestG2DuplicateStartRunsOnce(t *testing.T) {
	seen := &seenInput{}
	h := newHarness(t, harnessOpts{wf: multiplyWorkflow(t, "solver", false, seen)})
	req := h.startReq(t, "dup-1")
	var wg sync.WaitGroup
	var failed atomic.Int32
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := h.client.StartRollout(context.Background(), req); err != nil {
				failed.Add(1)
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d duplicate starts failed", failed.Load())
	}
	h.waitCompletion(t, "dup-1")
	h.waitDone(t, "dup-1")
	// After it finished a duplicate is still accepted and starts nothing.
	h.start(t, req)
	time.Sleep(50 * time.Millisecond)
	if n := seen.count(); n != 1 {
		t.Errorf("workflow ran %d times, want 1", n)
	}
	if n, m := len(h.g2.Completions("dup-1")), len(h.g2.GraderCallbacks("dup-1")); n != 1 || m != 1 {
		t.Errorf("%d completions and %d grader callbacks, want 1 each", n, m)
	}
	if n := len(h.g2.Chats()); n != 2 {
		t.Errorf("%d LLM calls, want the 2 of one run", n)
	}
}

func TestG2Health(t *testing.T) {
	t.Run("server limit", func(t *testing.T) {
		b := newBlockingWorkflow()
		h := newHarness(t, harnessOpts{wf: b.workflow(t), cfg: func(c *rollout.Config) { c.MaxConcurrent, c.MaxQueued = 2, 3 }})
		hr := h.health(t)
		want := &rolloutv1.Concurrency{MaxConcurrent: 2}
		if hr.GetStatus() != "ok" || hr.GetAgentLoop() != "blocking" || !proto.Equal(hr.GetConcurrency(), want) {
			t.Fatalf("idle health = %v", hr)
		}
		for _, id := range []string{"h-1", "h-2"} {
			h.start(t, h.startReq(t, id))
			b.waitStarted(t, id)
		}
		h.start(t, h.startReq(t, "h-3"))
		h.waitHealth(t, "2 running, 1 queued", func(c *rolloutv1.Concurrency) bool { return c.GetRunning() == 2 && c.GetQueued() == 1 })
		hr = h.health(t)
		if hr.GetConcurrency().GetMaxConcurrent() != 2 || hr.GetActiveRollouts() != 3 || hr.GetCompletedRollouts() != 0 {
			t.Errorf("busy health = %v", hr)
		}
		if _, err := h.client.CancelRollouts(context.Background(), &rolloutv1.CancelRolloutsRequest{All: true}); err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{"h-1", "h-2", "h-3"} {
			h.waitDone(t, id)
		}
		hr = h.health(t)
		if !proto.Equal(hr.GetConcurrency(), want) || hr.GetActiveRollouts() != 0 || hr.GetCompletedRollouts() != 3 {
			t.Errorf("health after cancelling = %v", hr)
		}
	})
	t.Run("workflow limit", func(t *testing.T) {
		wf, err := osmo.NewWorkflow(osmo.WorkflowFunc[testWFConfig](func(context.Context, *osmo.WorkflowContext[testWFConfig]) error { return nil }),
			&testWFConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "narrow", Concurrency: osmo.Concurrency{MaxConcurrent: 1}}})
		if err != nil {
			t.Fatal(err)
		}
		h := newHarness(t, harnessOpts{wf: wf, cfg: func(c *rollout.Config) { c.MaxConcurrent = 4 }})
		if hr := h.health(t); hr.GetConcurrency().GetMaxConcurrent() != 1 || hr.GetAgentLoop() != "narrow" {
			t.Errorf("health = %v, want the workflow's own limit of 1", hr)
		}
	})
}

// TestG2WorkflowConcurrencyLimit: an AgentWorkflow's own
// Concurrency.MaxConcurrent bounds how many of its rollouts run at once,
// below the server's limit; the others queue and run as slots free up.
func TestG2WorkflowConcurrencyLimit(t *testing.T) {
	const limit, rollouts = 2, 5
	var running, peak, runs atomic.Int32
	gate := make(chan struct{})
	wf, err := osmo.NewWorkflow(osmo.WorkflowFunc[testWFConfig](func(ctx context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		n := running.Add(1)
		defer running.Add(-1)
		runs.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return osmo.EncodeMessages([]osmo.Message{{"role": "assistant", "content": "done"}})
		}))
	}), &testWFConfig{AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "narrow", Concurrency: osmo.Concurrency{MaxConcurrent: limit}}})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, harnessOpts{wf: wf, cfg: func(c *rollout.Config) { c.MaxConcurrent = 8 }})
	for i := range rollouts {
		h.start(t, h.startReq(t, fmt.Sprintf("lim-%d", i)))
	}
	h.waitHealth(t, "2 running, 3 queued", func(c *rolloutv1.Concurrency) bool {
		return c.GetRunning() == limit && c.GetQueued() == rollouts-limit
	})
	// Give a third run every chance to start if the limit did not hold.
	time.Sleep(100 * time.Millisecond)
	if n, p := runs.Load(), peak.Load(); n != limit || p != limit {
		t.Fatalf("%d runs started, at most %d at once, with %d rollouts and a limit of %d", n, p, rollouts, limit)
	}
	queued := 0
	for i := range rollouts {
		if h.status(t, fmt.Sprintf("lim-%d", i)).GetStatus() == "queued" {
			queued++
		}
	}
	if queued != rollouts-limit {
		t.Errorf("%d rollouts report queued, want %d", queued, rollouts-limit)
	}
	close(gate)
	for i := range rollouts {
		id := fmt.Sprintf("lim-%d", i)
		if c := h.waitCompletion(t, id); c.Status != "success" {
			t.Errorf("%s: completion %s", id, c.Raw)
		}
		h.waitDone(t, id)
	}
	if n, p := runs.Load(), peak.Load(); n != rollouts || p != limit {
		t.Errorf("%d runs, at most %d at once; want %d runs, at most %d at once", n, p, rollouts, limit)
	}
}

// ctxGrader grades nothing: it waits until its context ends and returns
// the context's error, as the grader client does when the grader does not
// answer in time.
type ctxGrader struct{ calls atomic.Int32 }

func (g *ctxGrader) Grade(ctx context.Context, _ *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	g.calls.Add(1)
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestG2GraderTimeout: a grader that overruns grader_timeout_sec (well
// below the server's default) ends the rollout as a timeout failure,
// reported once in the grader callback, with no reward; the completion,
// posted before grading, is the workflow's success.
func TestG2GraderTimeout(t *testing.T) {
	for _, tc := range []struct {
		name   string
		grader func(t *testing.T) rollout.Grader
	}{
		{"grader waits for its context", func(*testing.T) rollout.Grader { return &ctxGrader{} }},
		{"grader service running a grader that ignores its context", func(t *testing.T) rollout.Grader {
			slow := osmo.GraderFunc(func(_ context.Context, gc *osmo.GraderContext) error {
				time.Sleep(3 * time.Second)
				for id := range gc.Samples {
					_ = gc.SetSampleReward(id, 1)
				}
				return nil
			})
			svc, err := grader.New(t.Context(), grader.Config{Graders: map[string]osmo.Grader{"slow": slow}, Default: "slow", State: newGraderState(t), Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = svc.Close() })
			return svc
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gr := tc.grader(t)
			h := newHarness(t, harnessOpts{
				wf:  multiplyWorkflow(t, "solver", false, nil),
				cfg: func(c *rollout.Config) { c.Grader, c.GradeTimeout = gr, 30*time.Second },
			})
			req := h.startReq(t, "gto-1")
			req.GraderTimeoutSec = proto.Float64(0.3)
			start := time.Now()
			h.start(t, req)
			comp := h.waitCompletion(t, "gto-1")
			gcb := h.waitGrader(t, "gto-1")
			elapsed := time.Since(start)
			if comp.Status != "success" {
				t.Errorf("completion = %s, want the workflow's success", comp.Raw)
			}
			// The grader service honours the same deadline and may report it
			// first, in its own words.
			assertFailure(t, "grader callback", gcb, "timeout", "")
			if m := gcb.ErrMessage; m == nil || !(strings.Contains(*m, "grader_timeout_sec") || strings.Contains(*m, "timed out after 300ms")) {
				t.Errorf("grader callback = %s, want the 0.3 s deadline named", gcb.Raw)
			}
			if s, ok := gcb.Samples["solver"]; !ok || s.Reward != nil {
				t.Errorf("grader callback samples = %s, want solver without a reward", gcb.Raw)
			}
			if elapsed < 300*time.Millisecond || elapsed > 2500*time.Millisecond {
				t.Errorf("grader callback after %v for a 0.3s grader_timeout_sec", elapsed)
			}
			r := h.waitDone(t, "gto-1")
			if r.GetState() != rolloutv1.State_STATE_FAILED || r.GetErrorCategory() != "timeout" || r.Reward != nil {
				t.Errorf("rollout = state %v category %q reward %v", r.GetState(), r.GetErrorCategory(), r.Reward)
			}
			if st := h.status(t, "gto-1"); st.GetStatus() != "failure" || st.GetErrCategory() != "timeout" || st.Reward != nil {
				t.Errorf("status = %v", st)
			}
			time.Sleep(100 * time.Millisecond)
			if n, m := len(h.g2.Completions("gto-1")), len(h.g2.GraderCallbacks("gto-1")); n != 1 || m != 1 {
				t.Errorf("%d completions and %d grader callbacks, want 1 each", n, m)
			}
		})
	}
}

// newGraderState is an embedded, in-memory NATS store for a grader service
// of a test, closed at cleanup.
func newGraderState(t *testing.T) *natsstore.Store {
	t.Helper()
	st, err := natsstore.Open(t.Context(), natsstore.Config{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

// TestSampleMessagesPassUnchanged: a source's messages reach the trainer as
// the bytes it returned: keys in their order, a number too large for a
// float64 exact.
func TestSampleMessagesPassUnchanged(t *testing.T) {
	const msg = `{"role":"assistant","content":"done","z":1,"a":{"y":2,"b":3},"id":12345678901234567890123}`
	wf := mustWorkflow(t, "verbatim", func(_ context.Context, wc *osmo.WorkflowContext[testWFConfig]) error {
		return wc.Rollout.Register("s", osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return []json.RawMessage{json.RawMessage(msg)}, nil
		}))
	})
	h := newHarness(t, harnessOpts{wf: wf})
	h.start(t, h.startReq(t, "verbatim-1"))
	gcb := h.waitGrader(t, "verbatim-1")
	if !strings.Contains(string(gcb.Raw), msg) {
		t.Errorf("grader callback does not carry the message as returned, %s:\n%s", msg, gcb.Raw)
	}
}
