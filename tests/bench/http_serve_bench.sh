#!/usr/bin/env bash
# http_serve_bench: the OpenAI HTTP API against the gRPC API on the same
# server (`serve --tp 2 --http-port 0`, the Qwen3-shaped demo model without
# tokenizer, token-id prompts of 64, 64 generated tokens, greedy):
#   - output tok/s, TTFT and ITL at 1 and 64 streams through both APIs; the
#     ratio HTTP / gRPC is the HTTP layer's cost (its ceiling is the gRPC
#     figure measured in the same run);
#   - 256 concurrent SSE streams held without errors.
# Not run by ctest (minutes); figures go to docs/BENCHMARKS.md.
#   tests/bench/http_serve_bench.sh [build/cli/exl3serve]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/exl3-http-bench-XXXXXX)
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
LOG=$WORK/serve.log
"$BIN" --log-level warning serve --model "$WORK/exl3" --tp 2 --threads-per-rank 1 --max-running 256 \
  --max-queue 512 --kv-pages 4096 --host 127.0.0.1 --port 0 --http-port 0 >"$LOG" 2>&1 &
SERVER_PID=$!
ADDR="" HTTP=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$LOG")
  HTTP=$(sed -n 's/^http: listening on //p' "$LOG")
  [ -n "$ADDR" ] && [ -n "$HTTP" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.1
done
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null
VOCAB=151936
echo "| API | streams | requests ok | output tok/s | TTFT p50 / p99 | ITL p50 / p99 | HTTP / gRPC tok/s |"
echo "|---|---|---|---|---|---|---|"
for c in 1 64; do
  n=$((c == 1 ? 16 : c * 2))
  out=$("$BIN" bench-serve --addr "$ADDR" --concurrency "$c" --prompt-len 64 --gen-len 64 --requests "$n")
  g_tps=$(sed -n 's/^  output throughput *\([0-9.]*\).*/\1/p' <<<"$out")
  g_ok=$(sed -n 's/^  requests ok *\([0-9]* \/ [0-9]*\).*/\1/p' <<<"$out")
  g_ttft=$(sed -n 's/^  TTFT p50 \/ p99 *\(.*\) ms/\1/p' <<<"$out")
  g_itl=$(sed -n 's/^  inter-token latency p50\/p99 *\(.*\) ms/\1/p' <<<"$out")
  echo "| gRPC | $c | $g_ok | $g_tps | $g_ttft ms | $g_itl ms | (ceiling) |"
  j=$(node "$SRC/tests/bench/http_load.cjs" "http://$HTTP/v1" "$c" 64 64 "$n" "$VOCAB")
  read -r ok failed tps t50 t99 i50 i99 < <(python3 -c '
import json, sys
j = json.loads(sys.argv[1])
print(j["ok"], j["failed"], j["tokens_per_s"], j["ttft_p50_ms"], j["ttft_p99_ms"], j["itl_p50_ms"], j["itl_p99_ms"])' "$j")
  ratio=$(awk -v h="$tps" -v g="$g_tps" 'BEGIN { printf "%.2f", h / g }')
  echo "| HTTP | $c | $ok / $((ok + failed)) | $tps | $t50 / $t99 ms | $i50 / $i99 ms | $ratio |"
done
j=$(node "$SRC/tests/bench/http_load.cjs" "http://$HTTP/v1" 256 16 32 256 "$VOCAB")
python3 -c '
import json, sys
j = json.loads(sys.argv[1])
print("| HTTP | 256 | %d / %d | %.1f | %.1f / %.1f ms | %.2f / %.2f ms | (256 SSE streams at once) |" % (
    j["ok"], j["ok"] + j["failed"], j["tokens_per_s"], j["ttft_p50_ms"], j["ttft_p99_ms"], j["itl_p50_ms"], j["itl_p99_ms"]))
if j["failed"]: print("errors:", j["errors"]); sys.exit(1)' "$j"
