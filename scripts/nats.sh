#!/usr/bin/env bash
# Builds the NATS server at a pinned version from the Go module proxy into
# ~/.cache/osmo/bin/nats-server, for the end-to-end tests that run a real
# NATS cluster. Prints the binary's path.
set -euo pipefail
version="v2.15.2"
# Outside the work tree so fresh clones on the same machine reuse it.
cache="${OSMO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/osmo}"
bin="$cache/bin/nats-server"
stamp="$cache/bin/.nats-server.version"
if [[ -x "$bin" && -f "$stamp" && "$(cat "$stamp")" == "$version" ]]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$cache/bin"
echo "nats-server: building $version" >&2
# `go install pkg@version` builds outside any module, so this repository's
# go.mod does not get in the way.
GOBIN="$cache/bin" GOFLAGS= go install "github.com/nats-io/nats-server/v2@$version"
echo "$version" > "$stamp"
echo "$bin"
