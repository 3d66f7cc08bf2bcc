#!/usr/bin/env bash
# Builds the Jaeger v2 all-in-one binary from its module source into
# ~/.cache/osmo/bin/jaeger (it cannot be `go install`ed: its go.mod has replace
# directives). Prints the binary's path. Takes several minutes the first time.
set -euo pipefail
version="v1.76.0"
# Outside the work tree so fresh clones on the same machine reuse it.
cache="${OSMO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/osmo}"
bin="$cache/bin/jaeger"
stamp="$cache/bin/.jaeger.version"
if [[ -x "$bin" && -f "$stamp" && "$(cat "$stamp")" == "$version" ]]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$cache/bin" "$cache/src"
dir="$(go mod download -json "github.com/jaegertracing/jaeger@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
src="$cache/src/jaeger-$version"
rm -rf "$src"
cp -r "$dir" "$src"
chmod -R u+w "$src"
echo "jaeger: building $version from source (several minutes)" >&2
(cd "$src" && GOFLAGS=-mod=mod go build -trimpath -o "$bin" ./cmd/jaeger)
echo "$version" > "$stamp"
echo "$bin"
