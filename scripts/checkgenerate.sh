#!/usr/bin/env bash
# Regenerates code from api/ and fails if the committed gen/ differs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="$(bash scripts/tools.sh)"
export PATH="$bin:$PATH"
buf lint
buf generate
if ! git diff --exit-code --stat -- gen; then
  echo "checkgenerate: gen/ is stale: run 'bash scripts/generate.sh' and commit the result" >&2
  exit 1
fi
untracked="$(git ls-files --others --exclude-standard -- gen)"
if [[ -n "$untracked" ]]; then
  echo "checkgenerate: generated files are not committed:" >&2
  echo "$untracked" >&2
  exit 1
fi
echo "checkgenerate: gen/ is current"
