#!/bin/bash
# Smoke run of the OpenAI request-body fuzzer (20 s) under ctest: no crash, every
# rejection a 400 with a message. $1 (the exl3serve binary) locates the build.
# Longer runs: tests/fuzz/run.sh openai_request 600.
set -euo pipefail
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
  echo "SKIP: clang++ not installed, the request-body fuzzer not run"
  exit 77
fi
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
exec bash "$src/tests/fuzz/run.sh" openai_request 20
