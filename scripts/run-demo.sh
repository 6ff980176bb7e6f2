#!/usr/bin/env bash
# The main job on its built-in default: installs Debian packages, builds, then
#  1. `exl3serve demo`: writes a small built-in Llama-shaped model (deterministic
#     random weights, large logit margins), converts it to EXL3 at 3.5 bits per
#     weight, prints the per-layer bits and error table, and compares greedy
#     generation of the original and the EXL3 model (one rank, and two);
#  2. starts a local 2-rank cluster on that EXL3 model (`exl3serve serve --tp 2`,
#     gRPC on a free loopback port), waits until it is ready, asks it for a
#     continuation through the gRPC API (`exl3serve client`), prints the
#     streamed answer, and stops the cluster.
# With arguments, runs `exl3serve ARGS...` instead (after installing and building).
# EXL3_BUILD_DIR picks the build directory; EXL3_SKIP_BUILD=1 skips steps 0 (packages, build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${EXL3_SKIP_BUILD:-0}" != 1 ]; then
  bash scripts/install-deps.sh
  bash scripts/build.sh
fi
BUILD_DIR=${EXL3_BUILD_DIR:-build}
BIN="$BUILD_DIR/cli/exl3serve"
[ $# -eq 0 ] || exec "$BIN" "$@"

WORK=$(mktemp -d /tmp/exl3serve-demo-XXXXXX)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

"$BIN" demo --work-dir "$WORK"

echo
echo "== a local cluster: coordinator + 2 rank processes, gRPC API on loopback =="
LOG="$WORK/serve.log"
"$BIN" --log-level warning serve --model "$WORK/exl3" --tp 2 --host 127.0.0.1 --port 0 >"$LOG" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$LOG")
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; echo "run-demo: serve exited"; exit 1; }
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$LOG"; echo "run-demo: serve did not bind a port in 60 s"; exit 1; }
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null ||
  { cat "$LOG"; echo "run-demo: the cluster did not become ready"; exit 1; }
sed -n 's/^serving /serving /p' "$LOG"
echo "\$ exl3serve client --addr $ADDR --prompt-ids 1,42,7,311 --max-tokens 16 --ids"
"$BIN" client --addr "$ADDR" --prompt-ids 1,42,7,311 --max-tokens 16 --ids
"$BIN" client --addr "$ADDR" --info
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || { cat "$LOG"; echo "run-demo: serve exited with an error"; exit 1; }
SERVER_PID=""
echo "cluster stopped"
