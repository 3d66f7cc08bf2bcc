#!/bin/sh
# An exec agent that fails: some output on both streams, then a last stderr
# line and exit status 1. The rollout must fail as agent_error carrying the
# end of stderr.
cat >/dev/null
echo "starting"
echo "warming up" >&2
echo "boom: bad things" >&2
exit 1
