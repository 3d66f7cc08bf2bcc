// Package rollout is the rollout service: it admits rollouts from a trainer,
// runs the workflow for each under a concurrency limit and a deadline,
// routes every LLM call through the LLM proxy (recording it), sends the
// finished samples to the grader service, and delivers the outcome back to
// the trainer, each callback once.
//
// Every rollout goes through one lifecycle, a file per stage: admit.go,
// work.go (the queue), run.go, collect.go, grade.go and deliver.go, strung
// together by lifecycle.go; shared.go is the state every replica shares.
// The Osmosis protocol generations are adapters at its edges (wire.go):
// g1.go for the remote rollout, g2.go for POST /rollout as SDK v0.2 speaks
// it, v03.go for what today's SDK adds. One server speaks all of them.
//
// The service is a gRPC server implementation (rolloutv1.RolloutServiceServer);
// its REST face, the Osmosis protocols, is the gateway's translation of it.
package rollout
