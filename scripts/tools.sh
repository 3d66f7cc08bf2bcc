#!/usr/bin/env bash
# Installs the pinned code generators and linters into ~/.cache/osmo/bin (idempotent, offline
# once the Go module cache has them). Source it or run it; it prints the bin dir.
set -euo pipefail
# Outside the work tree so fresh clones on the same machine reuse it.
cache="${OSMO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/osmo}"
bin="$cache/bin"
mkdir -p "$bin"

# name=module@version; bump here and nowhere else.
tools=(
  "buf=github.com/bufbuild/buf/cmd/buf@v1.75.0"
  "protoc-gen-go=google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12"
  "protoc-gen-go-grpc=google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2"
  "protoc-gen-connect-go=connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.21.1"
  "protoc-gen-grpc-gateway=github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-grpc-gateway@v2.32.0"
  "protoc-gen-openapiv2=github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-openapiv2@v2.32.0"
  "staticcheck=honnef.co/go/tools/cmd/staticcheck@v0.8.2"
)
for entry in "${tools[@]}"; do
  name="${entry%%=*}"
  pkg="${entry#*=}"
  stamp="$bin/.$name.version"
  if [[ -x "$bin/$name" && -f "$stamp" && "$(cat "$stamp")" == "$pkg" ]]; then
    continue
  fi
  echo "tools: installing $pkg" >&2
  GOBIN="$bin" GOFLAGS=-mod=mod go install "$pkg"
  echo "$pkg" > "$stamp"
done
echo "$bin"
