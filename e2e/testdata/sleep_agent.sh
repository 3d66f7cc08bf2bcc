#!/bin/sh
# An exec agent that never finishes and ignores SIGTERM (as does its child,
# which inherits the ignored signal): only SIGKILL of the whole process group
# ends it. It records its pid and its child's under
# $E2E_PID_DIR/$OSMOSIS_ROLLOUT_ID so the test can check both are gone.
trap '' TERM
sleep 300 &
path="$E2E_PID_DIR/$OSMOSIS_ROLLOUT_ID"
echo "$$ $!" >"$path.tmp"
mv "$path.tmp" "$path"
wait
