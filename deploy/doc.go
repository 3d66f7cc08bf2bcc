// Package deploy holds osmo's Kubernetes manifests (a kustomize base and the
// dev and prod overlays under base/ and overlays/) and the tests that prove
// them, the container image and the docker-compose file at the repository
// root consistent with the osmo binary:
//
//   - every command line the compose file and the manifests run names a real
//     osmo subcommand and flags it accepts, with values it can parse;
//   - addresses, ports, probes, Services, autoscalers, disruption budgets,
//     network policies, ConfigMaps and Secrets refer to one another correctly;
//   - the NATS JetStream holding the shared state is configured as nats-server
//     reads it: three nodes on their own claims in Kubernetes, one on a named
//     volume in compose, max_payload for a finished rollout's record, and the
//     rollout and grader services pointed at it with no state of their own;
//   - the compose services, started as processes with exactly the commands and
//     environment the compose file gives them (NATS and both rollout replicas
//     included), serve G1 rollouts end to end, with either rollout replica down.
//
// No Docker engine or cluster is needed: the tests load the compose file with
// compose-go, render the overlays with kustomize's krusty, and run the osmo
// binary and nats-server ($OSMO_NATS_BIN, else go.mod's version installed with
// go install into ~/.cache/osmo/bin) on loopback. See docs/deploy.md.
package deploy
