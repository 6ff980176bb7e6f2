# Sourced by the tests/cli/fuzz_*_test.sh smoke runs: `fuzz_smoke SECONDS
# TARGET...` runs each fuzzer (tests/fuzz/run.sh) for SECONDS, prints its
# run count, and fails with the log's tail on a finding; without clang++ the
# test is skipped (exit 77). $1 of the sourcing script (the exl3serve binary)
# locates the build.
fuzz_smoke() {
  local seconds=$1 target log
  shift
  local src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)}
  if ! command -v "${CLANGXX:-clang++}" >/dev/null; then
    echo "SKIP: clang++ not installed, fuzzers $* not run"
    exit 77
  fi
  for target in "$@"; do
    log=$EXL3_BUILD_DIR/fuzz-$target.log
    bash "$src/tests/fuzz/run.sh" "$target" "$seconds" >"$log" 2>&1 ||
      { tail -40 "$log"; echo "FAIL: $target fuzzer"; exit 1; }
    grep -a -E "^Done [0-9]+ runs" "$log" | sed "s/^/$target: /"
  done
  echo PASS
}
