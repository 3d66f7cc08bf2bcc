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
# The originals are kept in a directory of this run's own, so two runs on
# one machine never restore each other's files.
tidy="$(mktemp -d)"
trap 'rm -rf "$tidy"' EXIT
cp go.mod go.sum "$tidy/"
go mod tidy
if ! git diff --exit-code --stat -- go.mod go.sum; then
  cp "$tidy/go.mod" "$tidy/go.sum" .
  echo "go.mod/go.sum are not tidy: run 'go mod tidy' and commit" >&2
  exit 1
fi

step "JavaScript agents (examples/agents-js): install from the lockfile, unit tests, typecheck"
(cd examples/agents-js && npm ci --no-audit --no-fund && npm test && npm run typecheck)

step "Qwen3 policy double (internal/qwen3policy): install from the lockfile, unit tests"
(cd internal/qwen3policy && npm ci --no-audit --no-fund && npm test)

step "go vet"
go vet ./...

step "staticcheck"
"$(bash scripts/tools.sh)/staticcheck" ./...

# The end-to-end tracing test runs a real Jaeger; building it from source
# takes several minutes the first time (cached in ~/.cache/osmo afterwards), so
# it happens here, before the tests' clock starts.
step "Jaeger for the tracing test"
OSMO_JAEGER_BIN="$(bash scripts/jaeger.sh | tail -n 1)"
export OSMO_JAEGER_BIN

# The cluster tests run real NATS servers, built from the module proxy at a
# pinned version (cached in ~/.cache/osmo like Jaeger).
step "NATS server for the cluster tests"
OSMO_NATS_BIN="$(bash scripts/nats.sh | tail -n 1)"
export OSMO_NATS_BIN

step "go test"
# A failing end-to-end test logs the output of every process it ran, which
# can bury its own messages thousands of lines up; they are said again at
# the end, where a reader of the last screen sees them.
gotest="$tidy/go-test.log"
if ! go test -race -count=1 -timeout 20m ./... 2>&1 | tee "$gotest"; then
  printf '\n== what the failed tests said (the log of the processes they ran is above)\n'
  grep -E '^( *--- FAIL|FAIL|panic:| +[A-Za-z0-9_]+_test\.go:[0-9]+: )' "$gotest" | cut -c1-200 | tail -n 25
  exit 1
fi

# Every fuzz target (a decoder fed by the network or by users' files) runs
# a fixed number of inputs beyond its committed seed corpus (testdata/fuzz),
# which `go test` above already ran. A crash fails the build and leaves its
# input in the package's testdata/fuzz, to be committed as a regression case.
# The budget is a count, not a duration: with a duration, Go's coordinator
# can report its own deadline as a failure when a loaded machine starves the
# workers at the end of the window (golang/go#75804), with nothing to fix.
fuzztime="${OSMO_FUZZTIME:-5000x}"
step "fuzz: each target for $fuzztime"
while IFS=: read -r file name; do
  pkg="./$(dirname "$file")"
  echo "-- $pkg $name"
  go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" "$pkg"
done < <(git ls-files '*_test.go' | xargs grep -Ho '^func Fuzz[A-Za-z0-9_]*' | sed 's/func //' | sort)
