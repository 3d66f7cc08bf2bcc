package osmo_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

// EchoConfig is a workflow config: the shared part (name, description,
// concurrency) plus the workflow's own settings.
type EchoConfig struct {
	osmo.AgentWorkflowConfig
	Voices []string `json:"voices"`
}

// echoWorkflow answers the prompt once per configured voice, each answer a
// sample of its own. A real workflow would call the policy through
// wc.Rollout.Endpoint (or an integration) instead of echoing.
type echoWorkflow struct{}

func (echoWorkflow) Run(_ context.Context, wc *osmo.WorkflowContext[EchoConfig]) error {
	question, _ := wc.Prompt[len(wc.Prompt)-1]["content"].(string)
	for _, voice := range wc.Config.Voices {
		answer := osmo.Message{"role": "assistant", "content": voice + ": " + question}
		conversation := append(append([]osmo.Message(nil), wc.Prompt...), answer)
		err := wc.Rollout.Register("echo-"+voice, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) {
			return osmo.EncodeMessages(conversation)
		}))
		if err != nil {
			return err
		}
	}
	return nil
}

// quietRuntime is the smallest osmo.Runtime: enough to run a workflow in a
// test without a rollout service.
type quietRuntime struct{}

func (quietRuntime) Endpoint(string) osmo.Endpoint {
	return osmo.Endpoint{BaseURL: "http://127.0.0.1:0/v1"}
}
func (quietRuntime) Logger() *slog.Logger                 { return slog.New(slog.DiscardHandler) }
func (quietRuntime) LogEvent(string, map[string]any)      {}
func (quietRuntime) RecordToolCall(string, time.Duration) {}

func ExampleNewWorkflow() {
	wf, err := osmo.NewWorkflow(echoWorkflow{}, &EchoConfig{
		AgentWorkflowConfig: osmo.AgentWorkflowConfig{Name: "echo", Concurrency: osmo.Concurrency{MaxConcurrent: 2}},
		Voices:              []string{"calm", "loud"},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	r := osmotest.NewRollout("rollout-1", quietRuntime{})
	err = osmotest.Run(context.Background(), wf, r, &osmotest.Input{
		RolloutID: r.ID,
		Prompt:    []osmo.Message{{"role": "user", "content": "hello"}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("workflow:", wf.Name(), "max concurrent:", wf.MaxConcurrent())
	for _, s := range osmotest.Sources(r) {
		msgs, _ := osmotest.Messages(s.Source)
		fmt.Println(s.ID, msgs[len(msgs)-1]["content"])
	}
	// Output:
	// workflow: echo max concurrent: 2
	// echo-calm calm: hello
	// echo-loud loud: hello
}
