#!/bin/bash
# Smoke run of the safetensors header fuzzer (20 s) under ctest. $1 (the
# exl3serve binary) is not used. Longer runs: tests/fuzz/run.sh 600.
set -euo pipefail
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
  echo "SKIP: clang++ not installed, safetensors fuzzer not run"
  exit 0
fi
exec bash "$src/tests/fuzz/run.sh" 20
