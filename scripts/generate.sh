#!/usr/bin/env bash
# Regenerates Go (and its reflection-free marshal), gRPC, Connect, gateway code and the OpenAPI document from api/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="$(bash scripts/tools.sh)"
PATH="$bin:$PATH" buf generate
