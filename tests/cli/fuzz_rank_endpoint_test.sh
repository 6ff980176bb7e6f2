#!/bin/bash
# Smoke run (20 s) under ctest of the coordinator's side of the rank
# protocol: tests/fuzz/rank_endpoint_fuzz.cc (a fake rank's RankMessages over
# gRPC to the coordinator's RemoteRankGroup, with steps driven as the engine
# would). No crash, hang or sanitizer report. The first run compiles the
# rank group with clang (cached under $EXL3_BUILD_DIR/fuzz-rank_endpoint/obj).
# $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fuzz_smoke.sh"
fuzz_smoke 20 rank_endpoint
