#!/usr/bin/env bash
# soak: 256 concurrent streams of mixed lengths and sampling settings (greedy,
# seeded temperature / top-p / top-k, penalties with logprobs) for 10 minutes
# on a 2-rank cluster (`serve --tp 2`) of the Qwen3-shaped demo model (vocab
# 151 936); 0 errors and no stream lost, and the RSS of the coordinator and of
# each rank after warm-up, with its slope. Then an HTTP abuse phase
# (tests/bench/http_abuse.py: deep JSON, 8 MiB and over-limit bodies in every
# framing, smuggling-shaped requests, pipelining, slow clients, a burst of
# 300 connects, Range) against the same server's OpenAI API; fails unless the
# server still answers and the coordinator's RSS comes back within 10 % of
# its value before the phase. Not run by CI (minutes).
#
#   tests/bench/soak.sh [build/cli/exl3serve] [duration_s=600] [streams=256]
set -euo pipefail
BIN=${1:-build/cli/exl3serve}
DURATION=${2:-600}
STREAMS=${3:-256}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(dirname "$(dirname "$BIN")")
WORK=$(mktemp -d /tmp/exl3-soak-XXXXXX)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then
    local ranks
    ranks=$(pgrep -P "$SERVER_PID" 2>/dev/null || true)
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    for r in $ranks; do kill -KILL "$r" 2>/dev/null || true; done
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
"$BIN" --log-level warning make-demo-model --arch qwen3 --hidden 128 --intermediate 384 \
  --no-tokenizer --out "$WORK/hf" >/dev/null
"$BIN" --log-level warning convert --in "$WORK/hf" --out "$WORK/exl3" --bits 3.5 --head-bits 16 \
  --threads 2 --no-progress >/dev/null
LOG="$WORK/serve.log"
"$BIN" --log-level warning serve --model "$WORK/exl3" --tp 2 --max-running 64 --max-queue 1024 \
  --host 127.0.0.1 --port 0 --http-port 0 >"$LOG" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$LOG")
  [ -n "$ADDR" ] && break
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$LOG"; exit 1; }
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null
PIDS="$SERVER_PID,$(pgrep -P "$SERVER_PID" -f worker | paste -sd,)"
echo "soak: serve pid $SERVER_PID, ranks $(pgrep -P "$SERVER_PID" -f worker | paste -sd' '), $STREAMS streams, ${DURATION} s"
/usr/bin/python3 "$SRC/tests/bench/soak_client.py" --addr "$ADDR" --stubs "$BUILD/python" \
  --streams "$STREAMS" --duration-s "$DURATION" --vocab 151936 --pids "$PIDS" \
  --rss-every-s 10 --warmup-s $((DURATION / 5))

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
HTTP_PORT=$(sed -n 's/^http: listening on .*:\([0-9]*\)$/\1/p' "$LOG")
[ -n "$HTTP_PORT" ] || { echo "soak: no HTTP port in the log"; cat "$LOG"; exit 1; }
BASE=$(rss_kib "$SERVER_PID")
echo "soak: HTTP abuse phase on port $HTTP_PORT; coordinator RSS before: $((BASE / 1024)) MiB"
/usr/bin/python3 "$SRC/tests/bench/http_abuse.py" --port "$HTTP_PORT" --rounds "${ABUSE_ROUNDS:-3}"
PEAK=$(rss_kib "$SERVER_PID")
# Freed memory goes back as the handlers finish; allow it 10 s.
AFTER=$PEAK
for _ in $(seq 100); do
  AFTER=$(rss_kib "$SERVER_PID")
  [ "$AFTER" -le $((BASE * 11 / 10)) ] && break
  sleep 0.1
done
echo "soak: coordinator RSS after the abuse phase: $((PEAK / 1024)) MiB at its end, $((AFTER / 1024)) MiB settled" \
  "(before: $((BASE / 1024)) MiB)"
[ "$AFTER" -le $((BASE * 11 / 10)) ] || { echo "soak: FAIL: RSS did not return within 10 % of its baseline"; exit 1; }
echo "soak: PASS"
