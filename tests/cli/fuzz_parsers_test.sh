#!/bin/bash
# Smoke runs (15 s each) under ctest of the fuzzers for the text files of a
# downloaded model folder: chat templates (template and context), tokenizer
# files plus text, config.json (whole EXL3 folders and the cluster YAML:
# fuzz_files_test.sh; Step messages to a rank: fuzz_rank_protocol_test.sh).
# No crash, hang or sanitizer report. $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fuzz_smoke.sh"
fuzz_smoke 15 chat_template tokenizer model_config
