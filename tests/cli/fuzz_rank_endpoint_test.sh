#!/bin/bash
# Smoke run (20 s) under ctest of the coordinator's side of the rank
# protocol: tests/fuzz/rank_endpoint_fuzz.cc (a fake rank's RankMessages over
# gRPC to the coordinator's RemoteRankGroup, with steps driven as the engine
# would). No crash, hang or sanitizer report. The first run compiles the
# rank group with clang (cached under $EXL3_BUILD_DIR/fuzz-rank_endpoint/obj).
# $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
  echo "SKIP: clang++ not installed, the rank endpoint fuzzer not run"
  exit 77
fi
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
for target in rank_endpoint; do
  log=$EXL3_BUILD_DIR/fuzz-$target.log
  bash "$src/tests/fuzz/run.sh" "$target" 20 >"$log" 2>&1 ||
    { tail -40 "$log"; echo "FAIL: $target fuzzer"; exit 1; }
  grep -a -E "^Done [0-9]+ runs" "$log" | sed "s/^/$target: /"
done
echo PASS
