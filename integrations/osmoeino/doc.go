// Package osmoeino binds CloudWeGo Eino agents to an osmo rollout: the Eino
// counterpart of the Osmosis OsmosisStrandsAgent and OsmosisRolloutModel.
//
// Build the chat model inside AgentWorkflow.Run, from the ctx it is given:
//
//	cm, err := osmoeino.NewChatModel(ctx, "calculator-agent", osmoeino.WithTemperature(1))
//	if err != nil {
//		return err
//	}
//	agent, err := react.NewAgent(ctx, &react.AgentConfig{ToolCallingModel: cm, ToolsConfig: tools})
//	...
//	prompt, err := osmoeino.SchemaMessages(wc.Prompt)
//	...
//	_, err = agent.Generate(ctx, prompt)
//
// The model sends every call to the rollout's endpoint for its sample (the
// LLM proxy, which routes the placeholder model to the current policy) with
// the x-rollout-id and x-sample-id headers, and registers itself as the
// sample's source: the sample is the conversation of the model's latest call,
// its request messages followed by its reply, as OpenAI chat messages.
package osmoeino
