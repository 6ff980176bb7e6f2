#!/bin/bash
# Smoke run (20 s) under ctest of the rank protocol fuzzer
# (tests/fuzz/rank_protocol_fuzz.cc): structured sequences of Step messages to
# a rank loaded with a tiny EXL3 model. No crash, hang, sanitizer report, or
# KV page left behind. The first run compiles most of a rank with clang
# (cached under $EXL3_BUILD_DIR/fuzz-rank_protocol/obj). $1 locates the build.
# Longer runs: tests/fuzz/run.sh rank_protocol 1800 (docs/RELIABILITY.md).
set -euo pipefail
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
  echo "SKIP: clang++ not installed, the rank protocol fuzzer not run"
  exit 77
fi
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
log=$EXL3_BUILD_DIR/fuzz-rank_protocol.log
bash "$src/tests/fuzz/run.sh" rank_protocol 20 >"$log" 2>&1 ||
  { tail -40 "$log"; echo "FAIL: rank_protocol fuzzer"; exit 1; }
grep -E "^Done [0-9]+ runs" "$log" | sed "s/^/rank_protocol: /"
echo PASS
