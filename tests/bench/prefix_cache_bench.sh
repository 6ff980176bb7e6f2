#!/usr/bin/env bash
# prefix_cache_bench: the prefix cache on a multi-turn chat load (issue 17).
# A 2-rank cluster (`serve --tp 2`) on the Qwen3-shaped demo model (vocab
# 151 936, hidden 128, 2 layers, EXL3 3.5 bpw, 16-bit head, 2048 positions),
# then `bench-serve --turns 8 --system-len 1024 --prompt-len 64 --gen-len 64
# --concurrency 32`: 32 conversations in flight share one 1,024-token system
# prompt; each sends 8 turns of a 64-token user message and gets 64 tokens.
# Four configurations, each on a fresh server:
#   off        --no-prefix-cache, a pool that holds every conversation
#   ram        the prefix cache, the same pool
#   ram-small  the prefix cache, a pool too small for the working set
#   ram+disk   the same small pool plus a disk tier on each rank
# and prints bench-serve's per-turn table (TTFT p50/p99, prompt tokens, of
# them cached and computed) for each, then one line per configuration with
# turn 8's TTFT p50 against `off`. Not run by ctest (minutes); figures go to
# docs/BENCHMARKS.md.
#
#   tests/bench/prefix_cache_bench.sh [build/cli/exl3serve] [big-pool-pages] [small-pool-pages]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
BIG=${2:-4608}
SMALL=${3:-1536}
DISK_BLOCKS=8192
TURNS=8 SYSTEM=1024 USER=64 ANSWER=64 CONV=32
WORK=$(mktemp -d /tmp/exl3-prefix-bench-XXXXXX)
SERVER_PID=""
cleanup() {
  [ -n "$SERVER_PID" ] && kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
"$BIN" --log-level warning make-demo-model --arch qwen3 --hidden 128 --intermediate 384 \
  --no-tokenizer --out "$WORK/hf" >/dev/null
"$BIN" --log-level warning convert --in "$WORK/hf" --out "$WORK/exl3" --bits 3.5 --head-bits 16 \
  --threads 2 --no-progress >/dev/null

declare -A TTFT8 COMPUTED WALL
run() {  # NAME PAGES SERVE-FLAGS...
  local name=$1 pages=$2
  shift 2
  local log="$WORK/serve-$name.log"
  "$BIN" --log-level warning serve --model "$WORK/exl3" --tp 2 --threads-per-rank 1 \
    --max-running 64 --kv-pages "$pages" --host 127.0.0.1 --port 0 "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  local addr=""
  for _ in $(seq 600); do
    addr=$(sed -n 's/^listening on //p' "$log")
    [ -n "$addr" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.1
  done
  "$BIN" client --addr "$addr" --health --wait-ready-ms 120000 >/dev/null
  echo
  echo "== $name: --kv-pages $pages $*"
  local start=$SECONDS
  "$BIN" bench-serve --addr "$addr" --concurrency "$CONV" --turns "$TURNS" --system-len "$SYSTEM" \
    --prompt-len "$USER" --gen-len "$ANSWER" | tee "$WORK/bench-$name.txt"
  WALL[$name]=$((SECONDS - start))
  "$BIN" client --addr "$addr" --info | /usr/bin/python3 -c '
import json, sys
s = json.load(sys.stdin)["server"]
keys = ["num_preemptions", "prefix_cache_hits_tokens", "prefix_cache_queries_tokens",
        "prefix_cache_evicted_blocks", "prefix_cache_disk_saved_blocks",
        "prefix_cache_disk_hit_blocks", "prefix_cache_disk_miss_blocks"]
print("  server: " + ", ".join(f"{k} {s.get(k, 0)}" for k in keys))'
  # The per-turn rows: "TURN P50 ms P99 ms PROMPT CACHED COMPUTED" (means per conversation).
  TTFT8[$name]=$(awk -v t="$TURNS" '$1 == t && $3 == "ms" && NF == 8 { print $2 }' "$WORK/bench-$name.txt")
  COMPUTED[$name]=$(awk -v c="$CONV" '$1 ~ /^[0-9]+$/ && $3 == "ms" && NF == 8 { s += $8 * c } END { print s + 0 }' \
                    "$WORK/bench-$name.txt")
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID" || true
  SERVER_PID=""
}

run off "$BIG" --no-prefix-cache
run ram "$BIG"
run ram-small "$SMALL"
run ram+disk "$SMALL" --kv-disk-path "$WORK/kv-{rank}.bin" --kv-disk-blocks "$DISK_BLOCKS"

echo
echo "| configuration | turn $TURNS TTFT p50 | vs off | prompt tokens computed (all turns) | wall |"
echo "|---|---|---|---|---|"
for name in off ram ram-small ram+disk; do
  ratio=$(awk -v a="${TTFT8[off]}" -v b="${TTFT8[$name]}" 'BEGIN { if (b > 0) printf "%.1fx", a / b; else print "n/a" }')
  echo "| $name | ${TTFT8[$name]} ms | $ratio lower | ${COMPUTED[$name]} | ${WALL[$name]} s |"
done
