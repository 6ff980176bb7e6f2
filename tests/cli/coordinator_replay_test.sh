#!/usr/bin/env bash
# Surviving a dead rank, end to end: `exl3serve coordinator --config` with two
# `exl3serve worker --coordinator ... --reconnect` processes on a small test
# model (peaked logits: greedy decoding has clear margins), 32 concurrent
# greedy streams from the Python client (tests/cli/replay_client.py).
#
#   restart: once every stream has its first chunk, kill -9 rank 1 and start
#            a new rank 1: every stream completes with exactly the tokens it
#            gets alone (references computed first, one at a time, through the
#            same server), GetServerInfo.num_replays > 0, ready again.
#   no restart (timeouts.reform_ms 5000): kill -9 rank 1 and leave it dead:
#            every stream ends UNAVAILABLE within the bound + slack, the
#            coordinator stays up (GetServerInfo answers, not ready); start
#            rank 1 again -> ready again and a new request succeeds.
#
# Readiness is a handshake, not a sleep: the coordinator prints "listening on
# HOST:PORT" (api_address port 0) and writes the rank port (--port-file);
# `client --health --wait-ready-ms` watches grpc.health.v1 until SERVING.
# A trap stops every process on any exit. Needs /usr/bin/python3 with grpcio
# and the Python stubs in $EXL3_BUILD_DIR/python (else exit 77 = skip).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
WORK=$(mktemp -d)
COORD_PID=""
WORKER_PIDS=()   # every worker started (dead ones too)
PY_PID=""

stop_pid() {  # SIGTERM, up to 20 s, then SIGKILL; returns the exit status
  local pid=$1
  kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return $?; }
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && { echo "pid $pid did not stop in 20 s; SIGKILL"; kill -KILL "$pid"; }
  wait "$pid" 2>/dev/null
}
stop_all() {
  [ -n "$PY_PID" ] && { kill -KILL "$PY_PID" 2>/dev/null; wait "$PY_PID" 2>/dev/null; PY_PID=""; }
  [ -n "$COORD_PID" ] && { stop_pid "$COORD_PID"; COORD_PID=""; }
  for pid in "${WORKER_PIDS[@]}"; do stop_pid "$pid" >/dev/null 2>&1; done
  WORKER_PIDS=()
}
cleanup() { stop_all >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }; done
  exit 1
}

if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "skip: /usr/bin/python3 lacks grpcio/protobuf (apt python3-grpcio python3-protobuf)"; exit 77
fi
if [ ! -f "$BUILD/python/exl3serve/v1/generation_pb2_grpc.py" ]; then
  echo "skip: no Python stubs in $BUILD/python (needs /usr/bin/grpc_python_plugin)"; exit 77
fi
py() { /usr/bin/python3 "$SRC/tests/cli/replay_client.py" --addr "$ADDR" --stubs "$BUILD/python" "$@"; }

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"

# start_coordinator NAME REFORM_MS: sets ADDR (public API) and RANK_ADDR.
start_coordinator() {
  local name=$1 reform_ms=$2
  cat >"$WORK/$name.yaml" <<EOF
model_dir: $WORK/model
world_size: 2
listen_address: 127.0.0.1:0
api_address: 127.0.0.1:0
http_address: 127.0.0.1:0
shutdown_grace_ms: 2000
comm: {backend: shm}
kv: {num_pages: 400, page_size_tokens: 16}
timeouts: {heartbeat_interval_ms: 500, heartbeat_ms: 5000, reform_ms: $reform_ms}
EOF
  rm -f "$WORK/$name.port"
  "$BIN" --log-level warning coordinator --config "$WORK/$name.yaml" --port-file "$WORK/$name.port" \
      >"$WORK/$name-coordinator.log" 2>&1 &
  COORD_PID=$!
  ADDR="" RANK_ADDR=""
  for _ in $(seq 600); do  # both lines come before any rank registers
    ADDR=$(sed -n 's/^listening on //p' "$WORK/$name-coordinator.log" 2>/dev/null)
    [ -n "$ADDR" ] && [ -s "$WORK/$name.port" ] && break
    kill -0 "$COORD_PID" 2>/dev/null || fail "$name: the coordinator exited before listening"
    sleep 0.1
  done
  [ -n "$ADDR" ] && [ -s "$WORK/$name.port" ] || fail "$name: no 'listening on' line / port file in 60 s"
  RANK_ADDR="127.0.0.1:$(cat "$WORK/$name.port")"
}
# start_worker NAME RANK
start_worker() {
  "$BIN" --log-level warning worker --coordinator "$RANK_ADDR" --rank "$2" --world-size 2 \
      --reconnect --threads 1 >>"$WORK/$1-rank$2.log" 2>&1 &
  WORKER_PIDS+=($!)
  eval "RANK$2_PID=$!"
}
wait_ready() {  # bounded: the health RPC until SERVING
  "$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null ||
    fail "$1: not ready in 120 s"
}
# run_streams NAME EXPECT [--within-s S]: 32 streams, kill -9 rank 1 after every
# first chunk; with EXPECT=same a new rank 1 starts as soon as the kill happened.
run_streams() {
  local name=$1 expect=$2; shift 2
  rm -f "$WORK/$name.killed"
  py streams --refs "$WORK/refs.json" --kill-pid "$RANK1_PID" --killed-file "$WORK/$name.killed" \
      --expect "$expect" "$@" >"$WORK/$name-client.out" 2>&1 &
  PY_PID=$!
  if [ "$expect" = same ]; then
    for _ in $(seq 1500); do  # the client writes the file right after its SIGKILL
      [ -s "$WORK/$name.killed" ] && break
      kill -0 "$PY_PID" 2>/dev/null || break
      sleep 0.1
    done
    [ -s "$WORK/$name.killed" ] || { cat "$WORK/$name-client.out"; fail "$name: the client did not kill rank 1"; }
    start_worker "$name" 1
  fi
  wait "$PY_PID"; local rc=$?
  PY_PID=""
  cat "$WORK/$name-client.out"
  [ $rc = 0 ] || fail "$name: the streams (exit $rc)"
}

# --- 1. kill -9 rank 1, restart it: every stream completes with its solo tokens.
start_coordinator restart 60000
start_worker restart 0
start_worker restart 1
wait_ready restart
# The OpenAI HTTP API of the coordinator (http_address) answers on the same engine.
HTTP=$(sed -n 's/^http: listening on //p' "$WORK/restart-coordinator.log")
[ -n "$HTTP" ] || fail "no 'http: listening on' line from the coordinator"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://$HTTP/health")" = 200 ] || fail "HTTP /health"
curl -s "http://$HTTP/v1/completions" -d '{"prompt":[1,2,3],"max_tokens":4,"temperature":0,"return_token_ids":true}' |
  python3 -c 'import json,sys; j=json.load(sys.stdin); assert len(j["choices"][0]["token_ids"])==4, j' ||
  fail "HTTP /v1/completions on the coordinator"
for _ in $(seq 100); do  # printed by the status loop (every 250 ms) once ready
  grep -q "^serving $WORK/model on $ADDR (world_size=2)" "$WORK/restart-coordinator.log" && break
  sleep 0.1
done
grep -q "^serving $WORK/model on $ADDR (world_size=2)" "$WORK/restart-coordinator.log" ||
  fail "restart: no 'serving ... (world_size=2)' line within 10 s of SERVING"
py refs --out "$WORK/refs.json" --streams 32 --max-tokens 120 || fail "restart: references"
run_streams restart same
py info --ready 1 --min-replays 1 --up 0,1 || fail "restart: GetServerInfo after the replay"
wait_ready restart
"$BIN" client --addr "$ADDR" --health --deep >/dev/null || fail "restart: deep health after re-formation"
stop_pid "$COORD_PID"; rc=$?; COORD_PID=""
[ $rc = 0 ] || fail "restart: the coordinator exited $rc after SIGTERM"
grep -q "^stopped" "$WORK/restart-coordinator.log" || fail "restart: no 'stopped' line"
stop_all
echo "restart: OK"

# --- 2. kill -9 rank 1 and leave it dead (reform_ms 5000): UNAVAILABLE in time,
# the coordinator stays up, and is ready again once rank 1 is back.
start_coordinator norestart 5000
start_worker norestart 0
start_worker norestart 1
wait_ready norestart
run_streams norestart unavailable --within-s 20   # 5 s bound + 15 s slack
kill -0 "$COORD_PID" 2>/dev/null || fail "norestart: the coordinator died"
py info --ready 0 --down 1 || fail "norestart: GetServerInfo while rank 1 is missing"
if "$BIN" client --addr "$ADDR" --health >/dev/null 2>&1; then fail "norestart: health SERVING without rank 1"; fi
start_worker norestart 1
wait_ready norestart
py one --refs "$WORK/refs.json" || fail "norestart: a request after rank 1 came back"
py info --ready 1 || fail "norestart: GetServerInfo after rank 1 came back"
stop_pid "$COORD_PID"; rc=$?; COORD_PID=""
[ $rc = 0 ] || fail "norestart: the coordinator exited $rc after SIGTERM"
echo "norestart: OK"
echo "coordinator_replay: OK"
