#!/usr/bin/env bash
# Drain on SIGTERM (cli/serve_command.cc, coordinator/grpc_server.h): during
# 16 greedy streams the server gets SIGTERM; a new request is refused with
# UNAVAILABLE, grpc.health.v1 says NOT_SERVING while "liveness" stays
# SERVING, all 16 streams complete normally, and the server exits 0 within
# the bound (--shutdown-grace-ms, plus the ranks' stop). Client:
# tests/cli/drain_client.py (/usr/bin/python3, Debian python3-grpcio, stubs in
# $EXL3_BUILD_DIR/python); skips (77) without them. A trap stops the server.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "skip: /usr/bin/python3 lacks grpcio/protobuf"; exit 77
fi
[ -f "$BUILD/python/exl3serve/v1/generation_pb2_grpc.py" ] || { echo "skip: no Python stubs in $BUILD/python"; exit 77; }
WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; [ -f "$WORK/server.log" ] && { echo "--- server.log"; tail -30 "$WORK/server.log"; }; exit 1; }

GRACE_MS=60000   # the bound for the streams; they need a few seconds
"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"
for TP in 1 2; do
  "$BIN" --log-level warning serve --model "$WORK/model" --tp $TP --port 0 --kv-pages 512 \
      --shutdown-grace-ms $GRACE_MS >"$WORK/server.log" 2>&1 &
  SERVER_PID=$!
  ADDR=""
  for _ in $(seq 600); do
    ADDR=$(sed -n 's/^listening on //p' "$WORK/server.log")
    [ -n "$ADDR" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || fail "tp=$TP: serve exited before listening"
    sleep 0.1
  done
  [ -n "$ADDR" ] || fail "tp=$TP: no 'listening on' line"
  "$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null || fail "tp=$TP: not ready"
  START=$(date +%s%N)
  /usr/bin/python3 "$SRC/tests/cli/drain_client.py" --addr "$ADDR" --stubs "$BUILD/python" \
      --server-pid "$SERVER_PID" --streams 16 --max-tokens ${DRAIN_MAX_TOKENS:-400} ||
    fail "tp=$TP: drain client"
  # The bound: the grace period plus 15 s for the ranks to stop.
  BOUND_S=$((GRACE_MS / 1000 + 15))
  for _ in $(seq $((BOUND_S * 10))); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$SERVER_PID" 2>/dev/null && fail "tp=$TP: serve still running ${BOUND_S} s after SIGTERM"
  wait "$SERVER_PID"; RC=$?
  SERVER_PID=""
  TOOK_MS=$(( ($(date +%s%N) - START) / 1000000 ))
  [ $RC = 0 ] || fail "tp=$TP: serve exited $RC after SIGTERM"
  grep -q "^stopped" "$WORK/server.log" || fail "tp=$TP: no 'stopped' line"
  echo "drain: tp=$TP: serve exited 0 (streams + drain + exit: ${TOOK_MS} ms, bound ${BOUND_S} s)"
done
echo "PASS"
