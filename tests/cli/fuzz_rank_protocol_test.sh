#!/bin/bash
# Smoke run (20 s) under ctest of the rank side of the rank protocol:
# tests/fuzz/rank_protocol_fuzz.cc (structured sequences of Step messages to
# a rank loaded with a tiny EXL3 model; no KV page left behind). The
# coordinator's side: fuzz_rank_endpoint_test.sh. No crash, hang or
# sanitizer report. The first run compiles most of a rank with clang (cached under
# $EXL3_BUILD_DIR/fuzz-TARGET/obj). $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
  echo "SKIP: clang++ not installed, the rank protocol fuzzer not run"
  exit 77
fi
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
for target in rank_protocol; do
  log=$EXL3_BUILD_DIR/fuzz-$target.log
  bash "$src/tests/fuzz/run.sh" "$target" 20 >"$log" 2>&1 ||
    { tail -40 "$log"; echo "FAIL: $target fuzzer"; exit 1; }
  grep -a -E "^Done [0-9]+ runs" "$log" | sed "s/^/$target: /"
done
echo PASS
