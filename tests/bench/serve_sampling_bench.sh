#!/usr/bin/env bash
# serve_sampling_bench: end-to-end decode throughput of `exl3serve serve` on
# the Qwen3-shaped demo model (vocab 151 936, hidden 128, 2 layers, EXL3 3.5
# bpw, head 16 bit) at 1/16/64 streams, TP = 1 and 2, greedy and sampled
# (T 0.8, top-p 0.9, top-k 50), with bytes per step from rank 0 to the
# coordinator (token-id prompts: no tokenizer needed). Not run by ctest (minutes); figures go to docs/BENCHMARKS.md.
#
#   tests/bench/serve_sampling_bench.sh [build/cli/exl3serve] [streams...]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
shift || true
STREAMS=("$@")
[ ${#STREAMS[@]} -gt 0 ] || STREAMS=(1 16 64)
WORK=$(mktemp -d /tmp/exl3-serve-bench-XXXXXX)
SERVER_PID=""
cleanup() {
  [ -n "$SERVER_PID" ] && kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
"$BIN" --log-level warning make-demo-model --arch qwen3 --hidden 128 --intermediate 384 \
  --no-tokenizer --out "$WORK/hf" >/dev/null
"$BIN" --log-level warning convert --in "$WORK/hf" --out "$WORK/exl3" --bits 3.5 --head-bits 16 \
  --threads 2 --no-progress >/dev/null
echo "| TP | sampling | streams | output tok/s | engine step, mean | ITL p50 | coordinator share | rank 0 -> coordinator |"
echo "|---|---|---|---|---|---|---|---|"
for tp in 1 2; do
  LOG="$WORK/serve-$tp.log"
  "$BIN" --log-level warning serve --model "$WORK/exl3" --tp "$tp" --threads-per-rank 1 \
    --max-running 64 --host 127.0.0.1 --port 0 >"$LOG" 2>&1 &
  SERVER_PID=$!
  ADDR=""
  for _ in $(seq 600); do
    ADDR=$(sed -n 's/^listening on //p' "$LOG")
    [ -n "$ADDR" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 0.1
  done
  "$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null
  for mode in greedy sampled; do
    extra=()
    [ "$mode" = sampled ] && extra=(--temperature 0.8 --top-p 0.9 --top-k 50)
    for c in "${STREAMS[@]}"; do
      out=$("$BIN" bench-serve --addr "$ADDR" --concurrency "$c" --prompt-len 64 --gen-len 64 \
            --requests $((c * 2)) "${extra[@]}")
      tps=$(sed -n 's/^  output throughput *\([0-9.]*\).*/\1/p' <<<"$out")
      step=$(sed -n 's/^  engine steps *[0-9]*, mean \([0-9.]*\) ms/\1/p' <<<"$out")
      itl=$(sed -n 's/^  inter-token latency p50\/p99 *\([0-9.]*\) .*/\1/p' <<<"$out")
      share=$(sed -n 's/^  coordinator time \/ step *\([0-9.]*\) %.*/\1/p' <<<"$out")
      bytes=$(sed -n 's/^  rank 0 -> coordinator *\(.*\)/\1/p' <<<"$out")
      echo "| $tp | $mode | $c | $tps | $step ms | $itl ms | $share % | $bytes |"
    done
  done
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID" || true
  SERVER_PID=""
done
