// Package osmoopenai binds the OpenAI Go SDK (github.com/openai/openai-go/v3)
// to an osmo rollout: the Go counterpart of the Osmosis OpenAI Agents
// integration (OsmosisRolloutModel and OsmosisMemorySession).
//
// Inside AgentWorkflow.Run, NewSession creates a conversation registered as
// one sample of the active rollout; its client sends every chat completion
// through the rollout's LLM proxy under that sample id, and its items are
// what the grader reads. Run is a small tool-calling loop over a session that
// returns the last completion; RunText is the same loop for a caller that
// needs no more of the last reply than its text. Requests and replies are
// openai-go's own types, sent and decoded by its client. Messages keep the
// OpenAI chat JSON shape throughout, so samples look exactly like what went
// on the wire.
//
//	func (Workflow) Run(ctx context.Context, wc *osmo.WorkflowContext[Config]) error {
//		prompt, err := osmoopenai.MessageParams(wc.Prompt)
//		if err != nil {
//			return fmt.Errorf("%w: %w", osmo.ErrInvalidInput, err)
//		}
//		s, err := osmoopenai.NewSession(ctx, "my-agent")
//		if err != nil {
//			return err
//		}
//		s.AddItems(prompt...)
//		_, err = osmoopenai.RunText(ctx, s, openai.ChatCompletionNewParams{}, tools, 0)
//		return err
//	}
package osmoopenai

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/osmo-rl/osmo"
)

// Model is the placeholder policy model id (osmo.PlaceholderModel). Pass it
// as the model of every request: the trainer, or the proxy, routes it to the
// current policy. Session.Complete uses it when a request names no model.
const Model = osmo.PlaceholderModel

// Header names that bind a request to a rollout and a sample, as the Osmosis
// controllers read them.
const (
	headerRolloutID = "x-rollout-id"
	headerSampleID  = "x-sample-id"
)

// NewClient returns an OpenAI client bound to the rollout in ctx as sampleID:
// its base URL, API key and HTTP client are the rollout's endpoint for that
// sample, it sends x-rollout-id and x-sample-id on every request, and it does
// not retry (the LLM proxy retries upstream; a client retry would record the
// call twice).
//
// opts are applied after the SDK's defaults and before the binding, so they
// may set anything the binding does not (middleware, timeouts, retries),
// but cannot point the client elsewhere. Credentials and organization or
// project ids the SDK reads from OPENAI_* environment variables are never
// sent to the rollout's endpoint.
//
// Outside AgentWorkflow.Run (no rollout in ctx) the error wraps
// osmo.ErrNoRollout.
func NewClient(ctx context.Context, sampleID string, opts ...option.RequestOption) (openai.Client, error) {
	r, err := osmo.RolloutFromContext(ctx)
	if err != nil {
		return openai.Client{}, fmt.Errorf("osmoopenai.NewClient: sample %q: %w", sampleID, err)
	}
	ep, err := endpoint(r, sampleID)
	if err != nil {
		return openai.Client{}, fmt.Errorf("osmoopenai.NewClient: %w", err)
	}
	return openai.NewClient(clientOptions(r, ep, sampleID, opts)...), nil
}

// endpoint is r's LLM endpoint for sampleID, which must be a valid sample
// id.
func endpoint(r *osmo.Rollout, sampleID string) (osmo.Endpoint, error) {
	if err := osmo.ValidSampleID(sampleID); err != nil {
		return osmo.Endpoint{}, err
	}
	ep := r.Endpoint(sampleID)
	if ep.BaseURL == "" {
		// Without a base URL the SDK would fall back to api.openai.com: a
		// rollout's calls must never leave for a default endpoint.
		return osmo.Endpoint{}, fmt.Errorf("rollout %q has no LLM endpoint for sample %q", r.ID, sampleID)
	}
	return ep, nil
}

// clientOptions are the options of a client bound to r's endpoint ep as
// sampleID, opts among them.
func clientOptions(r *osmo.Rollout, ep osmo.Endpoint, sampleID string, opts []option.RequestOption) []option.RequestOption {
	all := make([]option.RequestOption, 0, len(opts)+len(ep.Headers)+8)
	// A session's service is built from these alone, without openai-go's
	// defaults (among them a copy of the default transport for each
	// client): the HTTP client is set here, for opts to replace.
	all = append(all, option.WithMaxRetries(0), option.WithHTTPClient(http.DefaultClient))
	all = append(all, opts...)
	all = append(all,
		option.WithBaseURL(ep.BaseURL),
		// Always set, even when empty, so a key from OPENAI_API_KEY or
		// OPENAI_ADMIN_KEY never reaches the proxy.
		option.WithAPIKey(ep.APIKey),
		option.WithAdminAPIKey(""),
		option.WithHeaderDel("OpenAI-Organization"),
		option.WithHeaderDel("OpenAI-Project"),
	)
	for k, v := range ep.Headers {
		all = append(all, option.WithHeader(k, v))
	}
	// Set last: the ids this client is bound to win over anything above.
	all = append(all, option.WithHeader(headerRolloutID, r.ID), option.WithHeader(headerSampleID, sampleID))
	if ep.HTTPClient != nil {
		all = append(all, option.WithHTTPClient(ep.HTTPClient))
	}
	return all
}

// errNoChoices is returned for a completion without choices.
var errNoChoices = errors.New("completion has no choices")
