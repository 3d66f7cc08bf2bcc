#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs pinned tools, proves
# generated code is current, checks formatting and vet, and runs every test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

step() { printf '\n== %s\n' "$*"; }

step "generated code is current"
bash scripts/checkgenerate.sh

step "gofmt"
unformatted="$(gofmt -l $(git ls-files '*.go'))"
if [[ -n "$unformatted" ]]; then
  echo "gofmt would change:" >&2
  echo "$unformatted" >&2
  exit 1
fi

step "go mod tidy is a no-op"
cp go.mod /tmp/osmo-go.mod.bak; cp go.sum /tmp/osmo-go.sum.bak
go mod tidy
if ! git diff --exit-code --stat -- go.mod go.sum; then
  cp /tmp/osmo-go.mod.bak go.mod; cp /tmp/osmo-go.sum.bak go.sum
  echo "go.mod/go.sum are not tidy: run 'go mod tidy' and commit" >&2
  exit 1
fi

step "JavaScript agents (examples/agents-js): install from the lockfile, unit tests, typecheck"
(cd examples/agents-js && npm ci --no-audit --no-fund && npm test && npm run typecheck)

step "go vet"
go vet ./...

# The end-to-end tracing test runs a real Jaeger; building it from source
# takes several minutes the first time (cached in ~/.cache/osmo afterwards), so
# it happens here, before the tests' clock starts.
step "Jaeger for the tracing test"
OSMO_JAEGER_BIN="$(bash scripts/jaeger.sh | tail -n 1)"
export OSMO_JAEGER_BIN

step "go test"
go test -race -count=1 -timeout 20m ./...
