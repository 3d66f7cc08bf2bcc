// Package rollout is the rollout service: it admits rollouts from a trainer,
// runs the agent workflow for each under a concurrency limit and a deadline,
// routes every LLM call through the LLM proxy (recording it), sends finished
// samples to the grader service, and delivers exactly one completion per
// rollout back to the trainer.
//
// The service is a gRPC server implementation (rolloutv1.RolloutServiceServer);
// its REST face, the Osmosis remote-rollout protocol, is the gateway's
// translation of it.
package rollout
