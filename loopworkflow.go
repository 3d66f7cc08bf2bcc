package osmo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
)

// AgentLoopWorkflow runs a RolloutAgentLoop as a Workflow, so the rollout
// service runs one kind of thing whatever the trainer speaks.
//
// Each rollout's loop gets a RolloutContext whose Chat reaches the policy
// through the rollout's endpoint for one sample, named after the loop (or
// "agent" when the loop's name cannot be a sample id). The loop's result
// becomes that sample: its final messages (or, when it returns none, the
// conversation the LLM proxy recorded), its extra fields, its finish reason
// and its own reward (SampleResult). An rc.Error result, a returned error, a
// nil result and a panic fail the rollout with the loop's message.
//
// The input's Request is the remote-rollout request when the trainer sent
// one (G1) and Tools what GetTools returned for it; otherwise a request is
// made from the prompt and metadata, with the default budgets and no
// completion_params, and GetTools is asked for it.
func AgentLoopWorkflow(loop RolloutAgentLoop) (*Workflow, error) {
	if loop == nil {
		return nil, errors.New("osmo.AgentLoopWorkflow: nil agent loop")
	}
	name := loop.Name()
	if name == "" {
		return nil, fmt.Errorf("osmo.AgentLoopWorkflow: %T has an empty Name", loop)
	}
	sampleID := name
	if ValidSampleID(sampleID) != nil {
		sampleID = "agent"
	}
	wf := &Workflow{name: name, loop: loop, loopSample: sampleID, validate: func() error { return nil }}
	wf.run = func(ctx context.Context, r *Rollout, in *workflowInput) error {
		req, tools := in.Request, in.Tools
		if req == nil {
			req = &RolloutRequest{
				RolloutID:      in.RolloutID,
				Messages:       in.Prompt,
				MaxTurns:       DefaultMaxTurns,
				MaxTokensTotal: DefaultMaxTokensTotal,
				Metadata:       in.Metadata,
			}
			var err error
			if tools, err = wf.toolsFor(req); err != nil {
				return err
			}
		}
		res, err := runAgentLoop(ctx, loop, newRolloutContext(r, sampleID, req, tools))
		// The sample is registered whatever happened: what the agent
		// recorded is reported even from a failed run.
		if rerr := r.Register(sampleID, &loopSample{res: res}); rerr != nil {
			return errors.Join(err, rerr)
		}
		return err
	}
	wf.rebind = func([]byte) (*Workflow, error) {
		return nil, fmt.Errorf("agent loop %q takes no config", name)
	}
	return wf, nil
}

// runAgentLoop calls the loop, turning a panic, a nil result, an unknown
// status and an rc.Error result into errors.
func runAgentLoop(ctx context.Context, loop RolloutAgentLoop, rc *RolloutContext) (res *RolloutResult, err error) {
	defer func() {
		if p := recover(); p != nil {
			res, err = nil, &PanicError{Value: p, Stack: debug.Stack(), what: "agent loop"}
		}
	}()
	res, err = loop.Run(ctx, rc)
	switch {
	case err != nil:
		return res, err
	case res == nil:
		return nil, errors.New("agent loop returned neither a result nor an error")
	case res.Status == StatusError:
		if res.ErrorMessage == "" {
			return res, errors.New("agent loop reported an error without a message")
		}
		return res, errors.New(res.ErrorMessage)
	case res.Status != StatusCompleted:
		return res, fmt.Errorf("agent loop returned unknown status %q", res.Status)
	}
	return res, nil
}

// SampleResult is implemented by sample sources that know how their agent
// ended: why it stopped and the reward it proposed (an agent loop's
// RolloutResult). The rollout service reports both with the sample; a
// grader's reward, when there is one, takes the place of the agent's.
type SampleResult interface {
	SampleFinishReason() string
	SampleAgentReward() *float64
}

// loopSample is the sample of an agent loop's run.
type loopSample struct{ res *RolloutResult }

func (s *loopSample) SampleMessages() ([]json.RawMessage, error) {
	if s.res == nil || s.res.Status != StatusCompleted {
		return nil, nil
	}
	return EncodeMessages(s.res.FinalMessages)
}

func (s *loopSample) SampleExtraFields() map[string]any {
	if s.res == nil {
		return nil
	}
	return s.res.ExtraFields
}

func (s *loopSample) SampleFinishReason() string {
	if s.res == nil || s.res.Status != StatusCompleted {
		return "error"
	}
	return s.res.FinishReason
}

func (s *loopSample) SampleAgentReward() *float64 {
	if s.res == nil || s.res.Status != StatusCompleted {
		return nil
	}
	return s.res.Reward
}

// maxChatAnswer bounds the body ChatCompletion reads: a completion larger
// than this is not one a policy sends.
const maxChatAnswer = 64 << 20

// ChatCompletion sends one non-streamed chat completion to ep: params
// (model defaults to PlaceholderModel) with messages, ep's bearer and
// headers, through ep's HTTP client. A non-200 answer is an error carrying
// its status and the OpenAI error message. It is what RolloutContext.Chat
// does for an agent loop, for workflows that need no framework.
func ChatCompletion(ctx context.Context, ep Endpoint, messages []Message, params map[string]any) (*ChatResult, error) {
	body := make(map[string]any, len(params)+2)
	for k, v := range params {
		body[k] = v
	}
	if _, ok := body["model"]; !ok {
		body["model"] = PlaceholderModel
	}
	body["messages"] = messages
	payload, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("chat: encode request: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.BaseURL+"/chat/completions", bytes.NewReader(payload))
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	if ep.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+ep.APIKey)
	}
	for k, v := range ep.Headers {
		req.Header.Set(k, v)
	}
	client := ep.HTTPClient
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxChatAnswer))
	if err != nil {
		return nil, fmt.Errorf("chat: read response: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("chat: LLM call failed: HTTP %d: %s", resp.StatusCode, errorText(data))
	}
	res, err := parseChatCompletion(data)
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	return res, nil
}

// errorText extracts an OpenAI error message, else a snippet of the body.
func errorText(body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	body = bytes.TrimSpace(body)
	if len(body) > 200 {
		body = append(body[:200:200], "..."...)
	}
	return string(body)
}
