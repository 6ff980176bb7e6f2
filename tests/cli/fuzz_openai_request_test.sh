#!/bin/bash
# Smoke run of the OpenAI request-body fuzzer (20 s) under ctest: no crash, every
# rejection a 400 with a message. $1 (the exl3serve binary) locates the build.
# Longer runs: tests/fuzz/run.sh openai_request 600.
set -euo pipefail
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fuzz_smoke.sh"
fuzz_smoke 20 openai_request
fuzz_smoke 15 http1_framing
