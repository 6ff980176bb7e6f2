#!/bin/bash
# Smoke runs (15 s each) under ctest of the fuzzers for whole EXL3 model
# folders (config.json + model.safetensors, loaded, decoded and sharded) and
# the cluster YAML (coordinator --config, launch). No crash, uncaught
# exception, hang or sanitizer report. $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fuzz_smoke.sh"
fuzz_smoke 15 model_folder cluster_config
