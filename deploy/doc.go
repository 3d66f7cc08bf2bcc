// Package deploy holds osmo's Kubernetes manifests (a kustomize base and the
// dev and prod overlays under base/ and overlays/) and the tests that prove
// them, the container image and the docker-compose file at the repository
// root consistent with the osmo binary:
//
//   - every command line the compose file and the manifests run names a real
//     osmo subcommand and flags it accepts, with values it can parse;
//   - addresses, ports, probes, Services, autoscalers, disruption budgets,
//     ConfigMaps and Secrets refer to one another correctly;
//   - the compose services, started as processes with exactly the commands and
//     environment the compose file gives them, serve a G1 rollout end to end.
//
// No Docker engine or cluster is needed: the tests load the compose file with
// compose-go, render the overlays with kustomize's krusty, and run the osmo
// binary on loopback. See docs/deploy.md.
package deploy
