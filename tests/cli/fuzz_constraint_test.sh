#!/bin/bash
# Smoke run (20 s) under ctest of the structured-output constraint fuzzer
# (tests/fuzz/constraint_fuzz.cc: JSON Schema, regex, GBNF and choice text
# compiled and walked). No crash, hang, stack overflow or sanitizer report.
# $1 locates the build. Longer runs: tests/fuzz/run.sh constraint 1800.
set -euo pipefail
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fuzz_smoke.sh"
fuzz_smoke 20 constraint
