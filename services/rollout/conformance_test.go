package rollout_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/services/rollout"
)

// The conformance cases: every protocol case runs against every wire, each
// driven over REST by a trainer of its generation, as connect-go runs its
// conformance cases across protocols. The workflow is the same for all of
// them (the calculator agent loop), so a case's outcome may differ between
// wires only in the words each wire has for it.

// trainer drives rollouts of one wire generation through the harness's
// gateway and reads their end the way its controller does.
type trainer struct {
	name string
	// start posts a rollout of id asking what 6 * 7 is, with label; spoil,
	// when set, breaks the request as this wire's bad input. It returns the
	// HTTP status of the answer, its body, and what waits for the
	// rollout's terminal callback(s) and reports them.
	start func(t *testing.T, h *harness, id, label string, spoil bool) (int, string, func() ended)
	// opts configures the harness for this trainer (its injected callback
	// failures, say).
	opts func(o *harnessOpts, failCallbacks int)
}

// ended is a rollout's end as a trainer saw it, in shared words.
type ended struct {
	// status is success, failure or cancelled (G1: COMPLETED is success;
	// ERROR is failure, or cancelled when it says so).
	status string
	// reward is the reward the trainer will train on.
	reward *float64
	// message is the error text; category the wire's err_category ("" for
	// G1, which has none).
	message, category string
	// messages is the length of the conversation the trainer got.
	messages int
	// terminal counts the terminal callbacks the trainer accepted (exactly
	// one is right), after a short settle.
	terminal int
}

// spoilField is the field each wire's bad input spoils, named in the 422.
var spoilField = map[string]string{"g1": "server_url", "g2": "chat_completions_url", "v0.3": "llm_api_key"}

var trainers = []trainer{
	{
		name: "g1",
		start: func(t *testing.T, h *harness, id, label string, spoil bool) (int, string, func() ended) {
			in := controller.InitRequest{
				RolloutID:        id,
				Messages:         []map[string]any{{"role": "user", "content": "What is 6 * 7?"}},
				CompletionParams: map[string]any{"temperature": 1.0},
				Metadata:         map[string]any{"ground_truth": label},
			}
			if spoil {
				in.ServerURL = "ftp://trainer.example"
			}
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			code, body, err := h.g1.Init(ctx, h.rest, "", in)
			if err != nil {
				t.Fatal(err)
			}
			return code, string(body), func() ended { return g1End(t, h, id) }
		},
		opts: func(o *harnessOpts, n int) { o.g1 = controller.Options{APIKey: g1Key, FailCompletions: n} },
	},
	{
		name: "g2",
		start: func(t *testing.T, h *harness, id, label string, spoil bool) (int, string, func() ended) {
			body := h.g2.StartBody(id, []map[string]any{{"role": "user", "content": "What is 6 * 7?"}})
			body["label"] = label
			if spoil {
				body["chat_completions_url"] = "ftp://trainer.example"
			}
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			code, _, data, err := h.g2.Start(ctx, h.rest, "", body)
			if err != nil {
				t.Fatal(err)
			}
			return code, string(data), func() ended { return g2End(t, h, id) }
		},
		opts: func(o *harnessOpts, n int) { o.g2 = controller.G2Options{APIKey: g2CtlKey, FailCallbacks: n} },
	},
	v03Trainer("v0.3", v03LLMKey),
	v03Trainer("v0.3 one secret", ""),
}

// g1End is a G1 rollout's end: its one completion.
func g1End(t *testing.T, h *harness, id string) ended {
	c := h.waitG1(t, id)
	e := ended{status: "success", reward: c.Reward, message: c.ErrorMessage, messages: len(c.FinalMessages)}
	if c.Status != "COMPLETED" {
		e.status = "failure"
		if strings.Contains(c.ErrorMessage, "cancelled by request") {
			e.status = "cancelled"
		}
	}
	settle()
	e.terminal = len(h.g1.Completions(id))
	return e
}

// g2End is a G2 rollout's end: its completion, then the grader callback
// that ends it, whose samples carry the reward (a v0.2 controller reads
// the map).
func g2End(t *testing.T, h *harness, id string) ended {
	comp, g := h.waitCompletion(t, id), h.waitGrader(t, id)
	e := ended{status: g.Status}
	if comp.Status == "cancelled" {
		e.status = "cancelled"
	}
	if g.ErrMessage != nil {
		e.message = *g.ErrMessage
	}
	if g.ErrCategory != nil {
		e.category = *g.ErrCategory
	}
	for _, s := range g.Samples {
		e.reward, e.messages = s.Reward, len(s.Messages)
	}
	settle()
	e.terminal = len(h.g2.GraderCallbacks(id))
	if n := len(h.g2.Completions(id)); n != 1 {
		t.Errorf("%d completion callbacks, want 1", n)
	}
	return e
}

// v03Trainer drives rollouts as today's SDK controller does, with a
// separate LLM key or (llmKey "") one shared secret.
func v03Trainer(name, llmKey string) trainer {
	return trainer{
		name: name,
		start: func(t *testing.T, h *harness, id, label string, spoil bool) (int, string, func() ended) {
			req := controller.V03RunRequest{
				RolloutID: id,
				Messages:  []map[string]any{{"role": "user", "content": "What is 6 * 7?"}},
				Label:     &label,
			}
			if spoil {
				// This controller never sends a bad start: post one by hand.
				code, body := postJSON(t, h.rest+"/rollout", map[string]any{
					"rollout_id": id, "initial_messages": req.Messages, "label": label,
					"chat_completions_url":    h.v03.ChatCompletionsURL(id),
					"completion_callback_url": h.v03.CompletionURL(id),
					"grader_callback_url":     h.v03.GraderURL(id),
					"controller_api_key":      v03CtlKey,
					"llm_api_key":             "",
				})
				return code, body, nil
			}
			// Run posts the start and waits for the end: a 202 is the only
			// answer it takes without an error.
			type run struct {
				res controller.V03Result
				err error
			}
			done := make(chan run, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 2*testTimeout)
				defer cancel()
				res, err := h.v03.Run(ctx, h.rest, "", req)
				done <- run{res, err}
			}()
			return http.StatusAccepted, "", func() ended {
				var r run
				select {
				case r = <-done:
				case <-time.After(3 * testTimeout):
					t.Fatalf("the v0.3 controller's run of %s did not end", id)
				}
				if r.err != nil {
					t.Fatalf("v0.3 run: %v (refused callbacks: %v)", r.err, h.v03.Rejected())
				}
				e := ended{status: r.res.Status}
				if c := r.res.Completion; c != nil && c.Status == "cancelled" {
					e.status = "cancelled"
				}
				if r.res.ErrMessage != nil {
					e.message = *r.res.ErrMessage
				}
				if r.res.ErrCategory != nil {
					e.category = *r.res.ErrCategory
				}
				if sm := r.res.Sample; sm != nil {
					e.reward, e.messages = sm.Reward, len(sm.Messages)
				}
				settle()
				e.terminal = len(h.v03.GraderCallbacks(id))
				return e
			}
		},
		opts: func(o *harnessOpts, n int) {
			o.v03 = controller.V03Options{CallbackKey: v03CtlKey, LLMKey: llmKey, FailCallbacks: n}
		},
	}
}

// postJSON posts body to url and returns the answer's status and body.
func postJSON(t *testing.T, url string, body any) (int, string) {
	t.Helper()
	data, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(answer)
}

// conformanceCase is one protocol case: how the harness is set up, what
// happens to the rollout once started, and what every wire's trainer must
// see.
type conformanceCase struct {
	name string
	// setup configures the harness (on top of the trainer's options).
	setup func(o *harnessOpts)
	// failCallbacks is how many callback posts the trainer refuses (503)
	// before it accepts.
	failCallbacks int
	// label is the row's ground truth ("42", the right answer, when
	// empty).
	label string
	// spoil sends this wire's bad input: the start must be refused with
	// 422 naming the field, and nothing run.
	spoil bool
	// during acts on the running rollout (cancels it, say).
	during func(t *testing.T, h *harness, id string)
	// check judges the end.
	check func(t *testing.T, wire string, e ended)
}

// calculatorGrader grades like the built-in calculator grader.
func calculatorGrader() rollout.Grader { return &fakeGrader{fn: rewardByCalculator} }

func withGrader(g func() rollout.Grader, more ...func(*rollout.Config)) func(*harnessOpts) {
	return func(o *harnessOpts) {
		o.cfg = func(c *rollout.Config) {
			c.Grader = g()
			for _, f := range more {
				f(c)
			}
		}
	}
}

// wantFailure checks a failure: its message contains text, and on the
// wires that carry one its category is category.
func wantFailure(t *testing.T, wire string, e ended, category, text string) {
	t.Helper()
	if e.status != "failure" || e.reward != nil || !strings.Contains(e.message, text) {
		t.Errorf("end = %+v, want a failure without reward mentioning %q", e, text)
	}
	if wire != "g1" && e.category != category {
		t.Errorf("err_category = %q, want %q", e.category, category)
	}
}

var conformanceCases = []conformanceCase{
	{
		name:  "happy path",
		setup: withGrader(calculatorGrader),
		check: func(t *testing.T, _ string, e ended) {
			if e.status != "success" || e.reward == nil || *e.reward != 1 || e.messages < 3 || e.message != "" {
				t.Errorf("end = %+v, want success with reward 1 and the conversation (prompt, tool call, result, answer)", e)
			}
		},
	},
	{
		name:  "wrong answer scores 0",
		setup: withGrader(calculatorGrader),
		label: "43",
		check: func(t *testing.T, _ string, e ended) {
			if e.status != "success" || e.reward == nil || *e.reward != 0 {
				t.Errorf("end = %+v, want success with reward 0", e)
			}
		},
	},
	{
		name:  "bad input",
		setup: withGrader(calculatorGrader),
		spoil: true,
	},
	{
		name:  "LLM 5xx",
		setup: func(o *harnessOpts) { withGrader(calculatorGrader)(o); o.mock = mockOpts(mockllm.Fail500) },
		check: func(t *testing.T, wire string, e ended) { wantFailure(t, wire, e, "http_error", "HTTP 502") },
	},
	{
		name:  "LLM 4xx",
		setup: func(o *harnessOpts) { withGrader(calculatorGrader)(o); o.mock = mockOpts(mockllm.Fail400) },
		check: func(t *testing.T, wire string, e ended) {
			wantFailure(t, wire, e, "http_error", "maximum context length")
		},
	},
	{
		name: "agent timeout",
		setup: func(o *harnessOpts) {
			withGrader(calculatorGrader, func(c *rollout.Config) { c.RolloutTimeout = 300 * time.Millisecond })(o)
			o.mock = mockOpts(mockllm.FailHang)
		},
		check: func(t *testing.T, wire string, e ended) { wantFailure(t, wire, e, "timeout", "timed out") },
	},
	{
		name:  "cancel",
		setup: func(o *harnessOpts) { withGrader(calculatorGrader)(o); o.mock = mockOpts(mockllm.FailHang) },
		during: func(t *testing.T, h *harness, id string) {
			waitStatus(t, h, id, "running")
			code, body := postJSON(t, h.rest+"/rollout/cancel", map[string]any{"ids": []string{id}})
			if code != http.StatusOK || !strings.Contains(body, `"cancelled_running"`) {
				t.Fatalf("cancel: %d %s", code, body)
			}
		},
		check: func(t *testing.T, _ string, e ended) {
			if e.status != "cancelled" || e.reward != nil || !strings.Contains(e.message, "cancelled by request") {
				t.Errorf("end = %+v, want cancelled by request", e)
			}
		},
	},
	{
		name: "grader fails",
		setup: withGrader(func() rollout.Grader {
			return &fakeGrader{fn: func(*graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
				return nil, errors.New("grader backend unreachable")
			}}
		}),
		check: func(t *testing.T, wire string, e ended) {
			wantFailure(t, wire, e, "agent_error", "grading failed: grader backend unreachable")
		},
	},
	{
		name:  "grader timeout",
		setup: withGrader(func() rollout.Grader { return &ctxGrader{} }, func(c *rollout.Config) { c.GradeTimeout = 300 * time.Millisecond }),
		check: func(t *testing.T, wire string, e ended) { wantFailure(t, wire, e, "timeout", "grading failed") },
	},
	{
		name:          "callback retries",
		setup:         withGrader(calculatorGrader),
		failCallbacks: 2,
		check: func(t *testing.T, _ string, e ended) {
			if e.status != "success" || e.reward == nil || *e.reward != 1 {
				t.Errorf("end = %+v, want success with reward 1 once the trainer accepts callbacks", e)
			}
		},
	},
}

func TestWireConformance(t *testing.T) {
	for _, tr := range trainers {
		t.Run(tr.name, func(t *testing.T) {
			for _, tc := range conformanceCases {
				t.Run(tc.name, func(t *testing.T) {
					t.Parallel()
					var o harnessOpts
					tr.opts(&o, tc.failCallbacks)
					if tc.setup != nil {
						tc.setup(&o)
					}
					h := newHarness(t, o)
					id := "conf-" + strings.ReplaceAll(tc.name, " ", "-")
					label := tc.label
					if label == "" {
						label = "42"
					}
					code, body, end := tr.start(t, h, id, label, tc.spoil)
					if tc.spoil {
						field := spoilField[strings.Fields(tr.name)[0]]
						if code != http.StatusUnprocessableEntity || !strings.Contains(body, `"detail":"`+field+`:`) {
							t.Fatalf("bad start answered %d %s, want 422 naming %s", code, body, field)
						}
						if st := h.status(t, id); st.GetStatus() != "unknown" {
							t.Errorf("a refused start left a rollout: %v", st)
						}
						return
					}
					if code != http.StatusAccepted {
						t.Fatalf("start answered %d %s, want 202", code, body)
					}
					if tc.during != nil {
						tc.during(t, h, id)
					}
					e := end()
					if e.terminal != 1 {
						t.Errorf("the trainer accepted %d terminal callbacks, want exactly 1", e.terminal)
					}
					tc.check(t, strings.Fields(tr.name)[0], e)
				})
			}
		})
	}
}

// waitStatus polls the G3 status until it reads want.
func waitStatus(t *testing.T, h *harness, id, want string) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for time.Now().Before(deadline) {
		if h.status(t, id).GetStatus() == want {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("%s never reached %q: %v", id, want, h.status(t, id))
}
