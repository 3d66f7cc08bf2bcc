// Command osmo runs the osmo rollout and grader services, their gateway, the
// LLM proxy and the tools around them. See `osmo help`.
package main

import "github.com/osmo-rl/osmo/cli"

func main() { cli.Main() }
