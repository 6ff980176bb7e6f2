#!/usr/bin/env bash
# Structured output end to end (issue 20): every constrained output the server
# returns validates under a checker independent of its masker
# (tests/structured/validate.cjs, through the official `openai` npm client):
#   * JSON Schema suite (tests/structured/schemas/, >= 30 real-world schemas:
#     nested objects, arrays, enums, consts, $ref/$defs recursion, anyOf/oneOf,
#     patterns, bounds) sent as response_format json_schema and as guided_json
#     (object and string), validated by ajv (draft 2020-12) after a strict JSON
#     parse (no duplicate keys); json_object; guided_regex (JavaScript RegExp);
#     guided_grammar (GBNF, checked by an equivalent RegExp or a recursive-
#     descent checker); guided_choice; tool calls with tool_choice "required"
#     and named (arguments validated by ajv against the tool's parameters);
#   * greedy and seeded sampling, batched (every item at once) and alone (one
#     request at a time; a rotating subset), the same tokens either way; on
#     the demo model also streamed (the same outputs) and with n = 2;
#   * the 400s: unsupported schema keywords (named), two constraints at once,
#     malformed regexes and grammars, a forced tool call with a response_format;
#   * on the Qwen3-tokenizer demo model (chat and completions; every suite
#     must be writable), and on stories260K and BabyLlama from ../shared
#     (completions; BabyLlama's 105-character vocabulary has no `{`, so its
#     object schemas are refused and reported, not failed), each served with
#     --tp 1 and --tp 2; the demo model also with n-gram drafts at every step
#     (outputs = the undrafted server's) and through gRPC (`exl3serve client
#     --json-schema/--regex/--grammar/--choice`: FINISH_REASON_CONSTRAINT_COMPLETE,
#     the same text as /v1/completions).
# Outputs cut by max_tokens ("length") are counted apart and checked as
# prefixes where a checker can; most outputs must complete; greedy ones cut
# are continued (to 480 tokens on the demo model, as far as the small models'
# contexts allow; the cut output must be a prefix of that one,
# which validates like any other). Server bugs and
# gaps found by the suite are listed in tests/structured/known_issues.json:
# those errors are counted as "known" and reported, not failed. The summary
# tables (per model/TP/mode and per suite: requests, complete, length-cut,
# refused, known, invalid) are printed at the end.
# Without node >= 20, npm or the registry, or the Qwen3 tokenizer: SKIP (77).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
DATA=$SRC/tests/structured
WORK=$(mktemp -d)
source "$SRC/tests/cli/lib/serve.sh"
cleanup() { serve_stop >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  [ -n "${LOG:-}" ] && [ -f "$LOG" ] && { echo "--- $LOG"; tail -20 "$LOG"; }
  exit 1
}

# Until the HTTP API parses the constraint fields the suite cannot run.
grep -qa guided_grammar "$BIN" || { echo "SKIP: $BIN has no structured output (guided_grammar) yet"; exit 77; }
# A copy of the binary: the ranks exec /proc/self/exe, and a rebuild while the
# test runs must not mix two builds.
cp "$BIN" "$WORK/exl3serve" || fail "copy $BIN"
BIN=$WORK/exl3serve
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node and npm are needed"; exit 77; }
[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ] || { echo "SKIP: openai@6 needs Node 20"; exit 77; }
npm_install() {  # npm_install DIR PACKAGE VERSION: once per build directory, under a lock
  (flock 9
   [ "$(node -p "require('$1/node_modules/$2/package.json').version" 2>/dev/null)" = "$3" ] ||
     npm install --prefix "$1" --no-audit --no-fund --loglevel=error "$2@$3" >"$WORK/npm.log" 2>&1
  ) 9>"$(dirname "$1")/.$(basename "$1").lock"  # openai_client_test.sh takes the same lock
}
if ! npm_install "$BUILD/npm-openai" openai 6.49.0 || ! npm_install "$BUILD/npm-ajv" ajv 8.17.1; then
  cat "$WORK/npm.log"; echo "SKIP: could not install openai@6.49.0 and ajv@8.17.1 from npm (no registry?)"; exit 77
fi
export NODE_PATH=$BUILD/npm-openai/node_modules:$BUILD/npm-ajv/node_modules
node "$DATA/validate.cjs" selftest "$DATA" || fail "the suite's own data and checkers"

TOK=$BUILD/demo-tokenizer
if ! (flock 9; bash "$SRC/scripts/fetch-demo-tokenizer.sh" "$TOK" >"$WORK/fetch.log" 2>&1) 9>"$BUILD/.demo-tokenizer.lock"; then
  cat "$WORK/fetch.log"; echo "SKIP: could not fetch the Qwen3 tokenizer (no network?)"; exit 77
fi
"$BIN" make-demo-model --arch qwen3 --hidden 128 --intermediate 384 --out "$WORK/qwen3-demo" \
  --tokenizer-dir "$TOK" >/dev/null || fail "make-demo-model"

SUMMARY=$WORK/summary.tsv
REQUESTS=$WORK/requests.jsonl
: >"$SUMMARY"
validate() {  # validate ARGS...: the suites against the server started last
  local http
  http=$(sed -n 's/^http: listening on //p' "$LOG")
  [ -n "$http" ] || fail "no 'http: listening on' line"
  timeout 600 node "$DATA/validate.cjs" run --base "http://$http/v1" --data "$DATA" \
    --known-issues "$DATA/known_issues.json" --summary "$SUMMARY" --log "$REQUESTS" "$@"
}

# gRPC: GenerateRequest.constraint through `exl3serve client` (greedy, the
# completions prompt): each output validates, FINISH_REASON_CONSTRAINT_COMPLETE
# ends the complete ones, and regex/grammar/choice outputs equal /v1/completions'.
regex_of() { node -p "require('$DATA/regex.json').find((r) => r.name === '$1').pattern"; }
grpc_checks() {  # grpc_checks HTTP_OUTPUTS_JSON
  local key flag value finish complete=0 args expect
  while IFS='|' read -r key flag value; do
    if [ "$flag" = --choice ]; then eval "args=($value)"; else args=("$flag" "$value"); fi
    "$BIN" client --addr "$ADDR" --prompt "Once upon a time" --add-special-tokens --temperature 0 --max-tokens 160 \
      "${args[@]}" >"$WORK/grpc.out" 2>"$WORK/grpc.err" || fail "gRPC $key: $(cat "$WORK/grpc.err")"
    finish=$(sed -n 's/^request .*: finish \([a-z_]*\),.*/\1/p' "$WORK/grpc.err")
    printf '%s' "$(cat "$WORK/grpc.out")" >"$WORK/grpc.txt"  # the client ends the text with a newline
    expect=(); [[ $key != schemas/* ]] && expect=(--expect "$1")
    node "$DATA/validate.cjs" check --data "$DATA" --item "$key" --finish "$finish" --text "$WORK/grpc.txt" \
      "${expect[@]}" || fail "gRPC $key"
    [ "$finish" = constraint_complete ] && complete=$((complete + 1))
  done <<EOF
schemas/order|--json-schema|$DATA/schemas/order.json
schemas/tree|--json-schema|$DATA/schemas/tree.json
schemas/greeting_unicode|--json-schema|$DATA/schemas/greeting_unicode.json
schemas/shape_union|--json-schema|$DATA/schemas/shape_union.json
regex/ipv4|--regex|$(regex_of ipv4)
regex/unicode_classes|--regex|$(regex_of unicode_classes)
grammar/arithmetic|--grammar|$DATA/grammars/arithmetic.gbnf
grammar/ok_object|--grammar|$DATA/grammars/ok_object.gbnf
choice/cities|--choice|--choice 'New York' --choice 'San Francisco' --choice 'Zürich' --choice 'São Paulo'
choice/prefix_overlap|--choice|--choice A --choice AB --choice ABC --choice ABD
EOF
  [ $complete -ge 5 ] || fail "gRPC: only $complete outputs ended with constraint_complete"
  echo "gRPC: 10 constrained outputs validate ($complete constraint_complete), regex/grammar/choice = /v1/completions"
}

# Batched modes run every item; alone modes (sequential, the slow part) every
# third on the demo model and every second on the small ones, from another
# offset at TP 2, so greedy and sampled each cover most items alone.
ALL_MODES=greedy-batched,sampled-batched,greedy-alone,sampled-alone
for tp in 1 2; do
  serve_start "$WORK/qwen3-demo" --tp $tp --http-port 0
  # TP 1 also streamed (the same outputs) and with n = 2 (each choice validates).
  extra=$([ $tp = 1 ] && echo ,greedy-streamed,sampled-n2)
  validate --label qwen3-demo --tp $tp --api chat --modes $ALL_MODES$extra --alone-every 3 --alone-offset $((tp - 1)) \
    --max-tokens 160 --extend-cut 480 --errors --outputs "$WORK/qwen3-tp$tp.json" || fail "qwen3-demo TP $tp (chat)"
  # /v1/completions takes the same constraint fields.
  extra=$([ $tp = 2 ] && echo ,greedy-streamed,sampled-n2)
  validate --label qwen3-compl --tp $tp --api completions --modes greedy-batched,sampled-batched$extra \
    --suites regex,grammar,choice,json_object --max-tokens 160 --errors --outputs "$WORK/compl-tp$tp.json" ||
    fail "qwen3-demo TP $tp (completions)"
  [ $tp = 2 ] && grpc_checks "$WORK/compl-tp$tp.json"
  serve_stop || fail "serve qwen3-demo --tp $tp exited non-zero"
done

# Speculative decoding (n-gram drafts, every step) with constraints: drafts are
# cut at the first refused token and the matcher rolled back after rejections;
# the outputs must be those of the undrafted TP 1 server above.
serve_start "$WORK/qwen3-demo" --tp 1 --http-port 0 --speculative ngram --draft-tokens 6 --no-draft-governor
validate --label qwen3-ngram --tp 1 --api chat --modes greedy-batched,sampled-batched --max-tokens 160 \
  --expect "$WORK/qwen3-tp1.json" || fail "qwen3-demo TP 1 with n-gram drafts"
serve_stop || fail "serve qwen3-demo --speculative ngram exited non-zero"

# The real models from ../shared, as Hugging Face directories with their tokenizers.
if [ -f "$SHARED/models/stories260K/stories260K.bin" ] && [ -f "$SHARED/models/babyllama-tok105/model5000.bin" ]; then
  "$BIN" import-llama2c --in "$SHARED/models/stories260K/stories260K.bin" \
    --tokenizer "$SHARED/models/stories260K/tok512.bin" --out "$WORK/stories260K" >/dev/null || fail "import stories260K"
  "$BIN" import-llama2c --in "$SHARED/models/babyllama-tok105/model5000.bin" \
    --tokenizer "$SHARED/models/babyllama-tok105/tok105.bin" --out "$WORK/babyllama" >/dev/null || fail "import BabyLlama"
  # BabyLlama's pieces (no byte fallback): the characters it can write at all.
  tail -n +4 "$SHARED/models/babyllama-tok105/tok105.vocab" | cut -f1 | sed 's/▁/ /g' | tr -d '\n' >"$WORK/babyllama.chars"
  for model in stories260K babyllama; do
    # Contexts: stories260K 512 positions, BabyLlama 256.
    chars=(); extend=384
    [ $model = babyllama ] && chars=(--vocab-chars "$WORK/babyllama.chars") && extend=224
    for tp in 1 2; do
      serve_start "$WORK/$model" --tp $tp --http-port 0
      validate --label $model --tp $tp --api completions --modes $ALL_MODES --alone-every 2 --alone-offset $((tp - 1)) \
        --max-tokens 128 --extend-cut $extend --suites schemas,regex,grammar,choice,json_object "${chars[@]}" ||
        fail "$model TP $tp"
      serve_stop || fail "serve $model --tp $tp exited non-zero"
    done
  done
else
  echo "stories260K / BabyLlama not found under $SHARED/models: only the demo model was tested"
fi

echo
echo "summary (complete: finished under the constraint and validated; length-cut: max_tokens first, checked as a prefix)"
# Per model, TP and mode over the suites (each run above printed its suites),
# then per suite over everything.
sum_rows() {  # sum_rows KEY_FIELDS...: rows of $SUMMARY summed by those fields, in order of appearance
  awk -F'\t' -v keys="$*" 'BEGIN { OFS = "\t"; nk = split(keys, k, " ") }
    { id = ""; for (j = 1; j <= nk; j++) id = id (j > 1 ? OFS : "") $k[j]
      if (!(id in seen)) { seen[id] = 1; order[++n] = id }
      for (c = 5; c <= 10; c++) total[id, c] += $c }
    END { for (r = 1; r <= n; r++) { line = order[r]; for (c = 5; c <= 10; c++) line = line OFS total[order[r], c]; print line } }' "$SUMMARY"
}
counts='requests\tcomplete\tlength-cut\trefused\tknown\tinvalid'
{ printf "model\tTP\tmode\t$counts\n"; grep -v '^errors' "$SUMMARY" | SUMMARY=/dev/stdin sum_rows 2 3 4; } | column -t -s $'\t'
echo
{ printf "suite\t$counts\n"; sum_rows 1; } | column -t -s $'\t'
# The known issues met (tests/structured/known_issues.json), once each.
node -e '
const seen = new Map();
for (const line of require("fs").readFileSync(process.argv[1], "utf8").split("\n").filter(Boolean)) {
  const r = JSON.parse(line);
  if (r.outcome === "known") seen.set(r.issue, (seen.get(r.issue) || 0) + 1);
}
for (const [id, n] of seen) console.log(`known issue ${id}: ${n} requests (tests/structured/known_issues.json)`);
const unmet = JSON.parse(require("fs").readFileSync(process.argv[2], "utf8")).issues.map((i) => i.id).filter((id) => !seen.has(id));
if (unmet.length) console.log(`known issues not met this run (fixed? remove them from known_issues.json): ${unmet.join(", ")}`);
' "$REQUESTS" "$DATA/known_issues.json"
echo "PASS"
