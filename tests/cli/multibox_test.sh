#!/usr/bin/env bash
# Multi-box cluster from one YAML with `exl3serve launch`: three network
# namespaces (the coordinator's box, box A with rank 0, box B with rank 1)
# joined by a Linux bridge in a 4th namespace (veth pairs, 10.2XX.Y.0/24 unique
# to this run; no traffic leaves these namespaces). Collectives: UCX over TCP,
# bootstrap on box A. Each box runs `ip netns exec NS exl3serve launch
# --config F --box X`; the API listens on 127.0.0.1 inside the coordinator's
# namespace and the client runs there.
#   1. a streamed request returns the ids of `exl3serve generate` on the model;
#   2. box B's link goes down: within the heartbeat timeout (+ slack) the
#      coordinator reports not ready, rank 1 down (GetServerInfo) and health
#      not SERVING;
#   3. the link comes back: the group re-forms (rank 1 reconnects) and a new
#      request returns the same ids.
# Processes and namespaces are removed on every exit path. Skips (77) without
# root or `ip netns`. $1: the exl3serve binary.
set -uo pipefail
BIN=$(readlink -f "$1")
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1; then
  echo "skip: needs root and iproute2 for network namespaces"; exit 77
fi
TAG="e3mb$$"
NSC="${TAG}c" NSA="${TAG}a" NSB="${TAG}b" NSBR="${TAG}br"
NET="10.$(( 200 + $$ % 50 )).$(( ($$ / 50) % 250 + 1 ))"
ADDR_C="$NET.1" ADDR_A="$NET.2" ADDR_B="$NET.3"
WORK=$(mktemp -d)
PIDS=()
HEARTBEAT_MS=3000
cleanup() {
  set +e
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq 100); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for ns in "$NSC" "$NSA" "$NSB" "$NSBR"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  wait 2>/dev/null
  for ns in "$NSC" "$NSA" "$NSB" "$NSBR"; do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }; done
  exit 1
}

if ! ip netns add "$NSBR" 2>/dev/null; then echo "skip: cannot create network namespaces here"; exit 77; fi
set -e
ip -n "$NSBR" link add "${TAG}br" type bridge
ip -n "$NSBR" link set "${TAG}br" up
ip -n "$NSBR" link set lo up
i=1
for ns in "$NSC" "$NSA" "$NSB"; do
  ip netns add "$ns"
  ip link add "${TAG}v$i" type veth peer name "${TAG}p$i"   # v: in the box, p: on the bridge
  ip link set "${TAG}v$i" netns "$ns"
  ip link set "${TAG}p$i" netns "$NSBR"
  ip -n "$NSBR" link set "${TAG}p$i" master "${TAG}br"
  ip -n "$NSBR" link set "${TAG}p$i" up
  ip -n "$ns" addr add "$NET.$i/24" dev "${TAG}v$i"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "${TAG}v$i" up
  i=$((i + 1))
done
set +e
DEV_B="${TAG}v3"
# (no ping(8) here: the first request shows the boxes reach each other)

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"
PROMPT=1,42,7,311,5
WANT=$("$BIN" --log-level warning generate --model "$WORK/model" --prompt-ids $PROMPT --max-tokens 16 \
       --ignore-eos --ids) || fail "generate"

cat >"$WORK/cluster.yaml" <<YAML
model_dir: $WORK/model
world_size: 2
listen_address: 0.0.0.0:50061
api_address: 127.0.0.1:50051
shutdown_grace_ms: 2000
comm: {backend: ucx, bootstrap_address: "$ADDR_A:50071", ucx_tls: tcp}
kv: {num_pages: 256, page_size_tokens: 16}
timeouts: {join_ms: 60000, heartbeat_interval_ms: 500, heartbeat_ms: $HEARTBEAT_MS, reform_ms: 60000, step_ms: 20000, collective_ms: 20000}
boxes:
  - {name: lead, address: $ADDR_C, coordinator: true}
  - {name: a, address: $ADDR_A, ranks: [0]}
  - {name: b, address: $ADDR_B, ranks: [1]}
YAML
export UCX_TLS=tcp
for spec in "$NSC:lead" "$NSA:a" "$NSB:b"; do
  ns=${spec%%:*} box=${spec##*:}
  ip netns exec "$ns" "$BIN" --log-level warning launch --config "$WORK/cluster.yaml" --box "$box" \
      --threads 1 >"$WORK/$box.log" 2>&1 &
  PIDS+=($!)
done
C() { ip netns exec "$NSC" "$BIN" client --addr 127.0.0.1:50051 "$@"; }
C --health --wait-ready-ms 120000 >/dev/null || fail "not ready in 120 s"

GOT=$(C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 60000) || fail "client request"
[ "$GOT" = "$WANT" ] || fail "ids differ: client '$GOT' vs generate '$WANT'"
echo "stream across boxes: $GOT (== generate)"

info_check() {  # READY DOWN_RANK: GetServerInfo says ready=READY and rank DOWN_RANK up=false ("" = all up)
  C --info --timeout-ms 5000 2>/dev/null | /usr/bin/python3 -c '
import json, sys
info = json.load(sys.stdin).get("server", {})
want_ready = sys.argv[1] == "1"
ranks = {int(r.get("rank", 0)): bool(r.get("up", False)) for r in info.get("ranks", [])}
ok = bool(info.get("ready", False)) == want_ready
if sys.argv[2]: ok = ok and ranks.get(int(sys.argv[2])) is False
else: ok = ok and len(ranks) == 2 and all(ranks.values())
sys.exit(0 if ok else 1)' "$1" "$2"
}
info_check 1 "" || { C --info; fail "GetServerInfo: not ready with every rank up"; }

# --- link down on box B: detected within the heartbeat timeout (+ slack)
ip -n "$NSB" link set "$DEV_B" down
T0=$(date +%s%N)
detected=""
for _ in $(seq 300); do
  if info_check 0 1; then detected=1; break; fi
  sleep 0.1
done
DT_MS=$(( ($(date +%s%N) - T0) / 1000000 ))
[ -n "$detected" ] || { C --info; fail "rank 1 not reported down 30 s after box B's link went down"; }
(( DT_MS <= HEARTBEAT_MS + 3000 )) || fail "loss detected after $DT_MS ms (heartbeat timeout $HEARTBEAT_MS ms)"
if C --health >/dev/null 2>&1; then fail "health SERVING with box B unreachable"; fi
echo "box B down: not ready, rank 1 down after $DT_MS ms (heartbeat_ms $HEARTBEAT_MS)"

# --- link up: the group re-forms, a new request succeeds
ip -n "$NSB" link set "$DEV_B" up
# (polled: grpc.health.v1's Watch may still say SERVING from before the loss)
T0=$(date +%s)
until C --health >/dev/null 2>&1; do
  (( $(date +%s) - T0 < 180 )) || { C --info; fail "not ready again 180 s after the link came back"; }
  sleep 0.5
done
info_check 1 "" || { C --info; fail "GetServerInfo after re-forming"; }
GOT=$(C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 60000) || fail "request after re-forming"
[ "$GOT" = "$WANT" ] || fail "ids after re-forming differ: '$GOT' vs '$WANT'"
grep -q "^coordinator: ready (group generation [2-9]" "$WORK/lead.log" || fail "no re-formed group generation in the coordinator's log"
echo "box B back: re-formed, $GOT"

# --- a rank that exits unexpectedly is restarted by its box's launch
P0=$(sed -n 's/^launch: rank 0 started (pid \([0-9]*\)).*/\1/p' "$WORK/a.log" | tail -1)
[ -n "$P0" ] || fail "no 'launch: rank 0 started' line"
kill -9 "$P0"
for _ in $(seq 100); do grep -q "^launch: rank 0 (pid $P0) exited" "$WORK/a.log" && break; sleep 0.1; done
grep -q "^launch: rank 0 (pid $P0) exited" "$WORK/a.log" || fail "launch did not notice rank 0's death"
T0=$(date +%s)
until C --health >/dev/null 2>&1 && [ "$(grep -c '^launch: rank 0 started' "$WORK/a.log")" -ge 2 ]; do
  (( $(date +%s) - T0 < 180 )) || { C --info; fail "not ready 180 s after rank 0 was killed"; }
  sleep 0.5
done
GOT=$(C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 60000) || fail "request after the restart"
[ "$GOT" = "$WANT" ] || fail "ids after the restart differ: '$GOT' vs '$WANT'"
echo "rank 0 killed: restarted by launch, ready again, $GOT"

# --- SIGTERM stops every box cleanly
for pid in "${PIDS[@]}"; do kill -TERM "$pid"; done
for pid in "${PIDS[@]}"; do
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "launch pid $pid did not stop 30 s after SIGTERM"
  wait "$pid"; rc=$?
  [ $rc = 0 ] || fail "launch pid $pid exited $rc after SIGTERM"
done
PIDS=()
for ns in "$NSC" "$NSA" "$NSB"; do
  [ -z "$(ip netns pids "$ns")" ] || fail "processes left in $ns after SIGTERM: $(ip netns pids "$ns")"
done
grep -q "^stopped" "$WORK/lead.log" || fail "the coordinator printed no 'stopped'"
echo "multibox: OK"
