#!/bin/bash
# Smoke run (20 s) under ctest of the rank side of the rank protocol:
# tests/fuzz/rank_protocol_fuzz.cc (structured sequences of Step messages to
# a rank loaded with a tiny EXL3 model; no KV page left behind). The
# coordinator's side: fuzz_rank_endpoint_test.sh. No crash, hang or
# sanitizer report. The first run compiles most of a rank with clang (cached under
# $EXL3_BUILD_DIR/fuzz-TARGET/obj). $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fuzz_smoke.sh"
fuzz_smoke 20 rank_protocol
