#!/bin/bash
# Smoke runs (15 s each) under ctest of the fuzzers for the text files of a
# downloaded model folder: chat templates (template and context), tokenizer
# files plus text, config.json (whole EXL3 folders and the cluster YAML:
# fuzz_files_test.sh; Step messages to a rank: fuzz_rank_protocol_test.sh).
# No crash, hang or sanitizer report. $1 locates the build.
# Longer runs: tests/fuzz/run.sh TARGET 1800 (docs/RELIABILITY.md).
set -euo pipefail
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
  echo "SKIP: clang++ not installed, the parser fuzzers not run"
  exit 77
fi
export EXL3_BUILD_DIR=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$1")")}
for target in chat_template tokenizer model_config; do
  bash "$src/tests/fuzz/run.sh" "$target" 15 >"$EXL3_BUILD_DIR/fuzz-$target.log" 2>&1 ||
    { tail -40 "$EXL3_BUILD_DIR/fuzz-$target.log"; echo "FAIL: $target fuzzer"; exit 1; }
  grep -E "^Done [0-9]+ runs" "$EXL3_BUILD_DIR/fuzz-$target.log" | sed "s/^/$target: /"
done
echo PASS
